"""The replay engine's fast path: compiled runs of page events, the Python handlers for the rest.

:class:`FastReplay` drives :func:`~kvtrail.forensics.replay.kernels.replay_page_events` over a
:class:`~kvtrail.forensics.replay.batch.ReplayBatch`. Pools (nodes) are independent, so each one's
events are replayed by the kernel up to its next event that needs Python; those events go through the
:class:`~kvtrail.forensics.replay.handlers.EventHandlers` (the pure path's own), with the same
:class:`~kvtrail.forensics.replay.event.ReplayEvent` the pure path builds, in row order across all pools
(always the earliest waiting one), and that pool's kernel resumes after it. Findings are therefore the
handlers' own, and the pure path (``ReplayEngine(fast=False)``) is the reference a test compares
against on random histories. Both work on the one :class:`~kvtrail.forensics.replay.state.ReplayState`
they are given.

What the handlers do besides page state is done in bulk, with the same result: request indices are
assigned and tenants named per batch (:meth:`ReplayState.register_requests`, both paths), releases are
remembered in order before it, and the prefill-rate samples of kernel-applied writes are summed per
(node, request) at the end of the batch.
"""

from __future__ import annotations

import heapq

import numpy as np
import pyarrow as pa

from kvtrail.audit.arrowutil import filled, valid_mask
from kvtrail.forensics.findings import UNVERIFIED
from kvtrail.forensics.replay import kernels as K
from kvtrail.forensics.replay.batch import JOIN_KINDS, PAGE_KINDS, ReplayBatch, codes_of, first_rows
from kvtrail.forensics.replay.event import NodeKey
from kvtrail.forensics.replay.handlers import EventHandlers
from kvtrail.forensics.replay.pagestate import PageState
from kvtrail.forensics.replay.shares import PrefixShares
from kvtrail.forensics.replay.state import ReplayState

_INT64_MAX = 2**63 - 1
_NO_POOL = tuple(spec.allocate(0) for spec in K.KERNEL_ARRAYS)  # what the kernel gets for a node without a pool
_NO_SHARES = PrefixShares(1).arrays()


_RECEIPT = len(PAGE_KINDS) + JOIN_KINDS.index("transfer_received")


def _unverified(b: ReplayBatch, kind: np.ndarray) -> np.ndarray:
    """Rows that are unverified transfer receipts: page events of their node (handled in Python)."""
    receipt = kind == _RECEIPT
    if not receipt.any():
        return receipt
    return receipt & (codes_of(b.column("status"), (UNVERIFIED,)) == 0)


class _Slot:
    """One node's pool as the kernel sees it: the PageState's arrays plus the kernel's own."""

    def __init__(self, key: NodeKey):
        self.key = key
        self.pool: PageState | None = None
        self.owner: np.ndarray | None = None  # the pool's owner array when `arrays` were taken (grow() replaces it)
        self.arrays: tuple[np.ndarray, ...] = _NO_POOL
        self.shares: tuple[np.ndarray, ...] = _NO_SHARES  # the pool's PrefixShares arrays
        self.multi = np.zeros(0, np.bool_)  # the kernel's "has extra holders" of this pool (multi)

    def refresh(self, pools: dict[NodeKey, PageState]) -> None:
        """Follow the node's current pool (a node_config may replace it, ``PageState.fit`` grow it, a
        handler grow its shares' slots)."""
        pool = pools.get(self.key)
        if pool is not None and pool is self.pool and pool.shares.index is not self.shares[0]:
            self.shares = pool.shares.arrays()
        if pool is self.pool and (pool is None or pool.owner is self.owner):
            return
        self.pool, self.owner = pool, None if pool is None else pool.owner
        if pool is None:
            self.arrays, self.shares, self.multi = _NO_POOL, _NO_SHARES, np.zeros(0, np.bool_)
            return
        self.shares = pool.shares.arrays()
        n = pool.dense_n  # the kernel sees the dense part only (pagestate)
        multi, stamp = (spec.allocate(n) for spec in K.SCRATCH_ARRAYS)
        multi[[p for p in pool.extra if 0 <= p < n]] = True  # page has extra holders (double ownership)
        self.arrays, self.multi = pool.arrays() + (multi, stamp), multi

    def after_handler(self, pools: dict[NodeKey, PageState], pages: np.ndarray) -> None:
        """A handler ran on this pool: mirror 'has extra holders' for the pages it may have changed."""
        self.refresh(pools)
        if self.pool is None:
            return
        pages = pages[(pages >= 0) & (pages < len(self.multi))]
        extra = self.pool.extra
        self.multi[pages] = np.isin(pages, np.fromiter(extra, np.int64, len(extra))) if extra else False


class FastReplay:
    """The fast path of one replay: one slot per node seen, over the state and handlers it is given."""

    def __init__(self, state: ReplayState, handlers: EventHandlers, need_joins: bool = True):
        self.state = state
        self.handlers = handlers
        self.need_joins = need_joins
        self.slot_of: dict[NodeKey, int] = {}
        self.slots: list[_Slot] = []
        # Per request index: a code of its tenant (-1: none) and the order number from which the
        # handlers know it (what the kernel needs to tell a cross-tenant prefix read, F10).
        self.tenant_code = np.zeros(0, np.int32)
        self.tenant_ord = np.zeros(0, np.int64)
        self.tenant_codes: dict[str, int] = {}

    def _slot(self, key: NodeKey) -> int:
        s = self.slot_of.get(key)
        if s is None:
            s = self.slot_of[key] = len(self.slots)
            self.slots.append(_Slot(key))
        return s

    # ---- one batch -----------------------------------------------------------------------------------

    def ops(self, b: ReplayBatch, kind: np.ndarray) -> np.ndarray:
        """The kernel operation of each row (``kind``: index in PAGE_KINDS + JOIN_KINDS + node_config)."""
        purpose = codes_of(b.column("purpose"), ("decode_growth", "prefix_hit"))
        # node_config and kinds this module does not know (their handler, if any, decides) go to Python
        op = np.full(b.num_rows, K.OP_PYTHON, np.int8)
        if not self.need_joins:
            op[(kind >= len(PAGE_KINDS)) & (kind < len(PAGE_KINDS) + len(JOIN_KINDS))] = K.OP_SKIP
        op[kind == 0] = np.where(
            purpose[kind == 0] == 0, K.OP_GROWTH, np.where(purpose[kind == 0] == 1, K.OP_PREFIX, K.OP_ALLOC)
        )
        op[kind == 1] = K.OP_FREE
        op[kind == 2] = K.OP_WRITE
        op[kind == 3] = K.OP_READ
        # Prefill-rate samples need both token bounds (the handler raises without them).
        forward = codes_of(b.column("source"), ("forward",)) == 0
        no_tokens = ~valid_mask(b.column("token_start")) | ~valid_mask(b.column("token_end"))
        op[(kind == 2) & forward & no_tokens] = K.OP_PYTHON
        op[filled(b.column("seq"), 0) > _INT64_MAX] = K.OP_PYTHON  # int64 keys
        op[_unverified(b, kind)] = K.OP_PYTHON  # its handler changes page state: judged even without the joins
        return op

    def feed(self, b: ReplayBatch) -> None:
        """Replay one batch (engine order) into the state."""
        state = self.state
        n = b.num_rows
        ord0 = state.take_ords(n)
        kind = codes_of(b.column("kind"), PAGE_KINDS + JOIN_KINDS + ("node_config",))
        req = state.register_requests(
            (kind >= 0) & (kind < len(PAGE_KINDS)), b.rcode, b.request_ids, b.column("tenant_id"), ord0
        ).astype(np.int32)
        op = self.ops(b, kind)
        node_slot = np.array([self._slot((c, nd)) for c, nd, *_ in b.idents], np.int64)
        slot = node_slot[b.producer] if n else np.zeros(0, np.int64)
        self._tenant_arrays()
        run = _Run(self, b, op, req, ord0)
        known = b.events(np.flatnonzero(op == K.OP_PYTHON), ord0)
        handle = self.handlers.handle
        # One lane of rows per pool (page events and node_config), in order.
        pooled = (
            ((kind >= 0) & (kind < len(PAGE_KINDS)))
            | (kind == len(PAGE_KINDS) + len(JOIN_KINDS))
            | _unverified(b, kind)
        )  # an unverified landing leaves its pages' writer unknown
        rows = np.flatnonzero(pooled)
        by_slot = rows[
            np.argsort(slot[rows].astype(np.uint16 if len(self.slots) < 1 << 16 else np.int64), kind="stable")
        ]
        lanes_slot = np.unique(slot[rows]).tolist()
        counts = np.bincount(slot[rows], minlength=len(self.slots))[lanes_slot]
        lanes = np.split(by_slot, np.cumsum(counts)[:-1]) if lanes_slot else []
        pos = [run(lanes[k], 0, s) for k, s in enumerate(lanes_slot)]
        waiting = [(int(lanes[k][pos[k]]), k) for k in range(len(lanes)) if pos[k] < len(lanes[k])]
        heapq.heapify(waiting)  # each lane's next event for Python, earliest first
        handled = np.zeros(n, np.bool_)
        while waiting:
            row, k = heapq.heappop(waiting)
            ev = known.pop(row, None)
            handle(ev if ev is not None else b.event(row, ord0 + row))
            handled[row] = True
            self.slots[lanes_slot[k]].after_handler(state.pools, b.pages[b.poff[row] : b.poff[row + 1]])
            pos[k] = run(lanes[k], pos[k] + 1, lanes_slot[k])
            if pos[k] < len(lanes[k]):
                heapq.heappush(waiting, (int(lanes[k][pos[k]]), k))
        # The other kinds only feed the cross-node joins, which judge when findings are asked for: their
        # order among themselves is kept, their place among the page events does not matter.
        for row in np.flatnonzero(~pooled & (op == K.OP_PYTHON)).tolist():
            handle(known.pop(row))
        hit_pages = state.joins.hit_pages
        hits = np.flatnonzero(run.hit)
        tenant_ids = b.column("tenant_id").take(pa.array(hits)).to_pylist() if len(hits) else []
        for row, tenant in zip(hits.tolist(), tenant_ids):  # what CrossNodeJoins.prefix_hit adds for the kernel's
            key = (self.slots[slot[row]].key, b.request_ids[b.rcode[row]], tenant)
            hit_pages[key] = hit_pages.get(key, 0) + int(b.poff[row + 1] - b.poff[row])
        roles = state.joins.role
        last = n - 1 - first_rows(b.producer[::-1], len(b.idents))
        for p in np.sort(last[last >= 0]).tolist():  # the last row's role wins, as row by row
            ident = b.idents[b.producer[p]]
            roles[(ident[0], ident[1])] = ident[2]
        if self.need_joins:
            self._forward_samples(b, op, handled, slot, run.wall, ord0)

    def _tenant_arrays(self) -> None:
        """Bring tenant_code / tenant_ord up to the state: each request's tenant and the order number from
        which it is named (both set when the batch's requests were registered)."""
        state, old = self.state, len(self.tenant_code)
        if len(state.requests) > old:
            # each new request's tenant code (-1: none), codes given in order of first appearance (as _tenant)
            enc = pa.array(state.request_tenants[old:], pa.string()).dictionary_encode()
            tc = self.tenant_codes
            by_name = np.array([tc.setdefault(t, len(tc)) for t in enc.dictionary.to_pylist()] + [-1], np.int32)
            codes = by_name[filled(enc.indices, -1)]
            self.tenant_code = np.concatenate([self.tenant_code, codes])
            self.tenant_ord = np.concatenate([self.tenant_ord, np.array(state.tenant_since[old:], np.int64)])
        for r in state.renamed:
            if r < old:
                t = state.request_tenants[r]
                self.tenant_code[r] = -1 if t is None else self._tenant(t)
                self.tenant_ord[r] = state.tenant_since[r]
        state.renamed.clear()

    def _tenant(self, tenant: str) -> int:
        return self.tenant_codes.setdefault(tenant, len(self.tenant_codes))

    def _forward_samples(
        self, b: ReplayBatch, op: np.ndarray, handled: np.ndarray, slot: np.ndarray, wall: np.ndarray, ord0: int
    ) -> None:
        """What ``CrossNodeJoins.written`` records for the forward writes the kernel applied."""
        rows = np.flatnonzero(
            (op == K.OP_WRITE) & ~handled & (b.rcode >= 0) & (codes_of(b.column("source"), ("forward",)) == 0)
        )
        if not len(rows):
            return
        tokens = (b.ints("token_end")[rows] - b.ints("token_start")[rows]).tolist()
        keys = [s.key for s in self.slots]
        # (node_key, ord, wall_ns, request_id, tokens) per row, built by zip and map rather than a loop
        self.state.joins.forward_writes.extend(
            zip(
                map(keys.__getitem__, slot[rows].tolist()),
                (rows + ord0).tolist(),
                wall[rows].tolist(),
                map(b.request_ids.__getitem__, b.rcode[rows].tolist()),
                tokens,
            )
        )


class _Run:
    """Runs the kernel over one lane of a batch from a position; returns where it stopped."""

    def __init__(self, fast: FastReplay, b: ReplayBatch, op: np.ndarray, req: np.ndarray, ord0: int):
        self.fast, self.b, self.op, self.req, self.ord0 = fast, b, op, req, ord0
        self.seq, self.wall = b.ints("seq"), b.ints("wall_ns")
        self.freed = np.zeros(b.num_rows, np.int64)
        self.hit = np.zeros(b.num_rows, np.bool_)  # prefix hits the kernel applied
        self.allow_sharing = fast.handlers.policy.allow_tenant_cache_sharing

    def __call__(self, rows: np.ndarray, start: int, s: int) -> int:
        b, slot = self.b, self.fast.slots[s]
        slot.refresh(self.fast.state.pools)
        stop, nfreed = K.replay_page_events(  # type: ignore[call-arg]  # numba's Dispatcher stub
            rows,
            start,
            self.ord0,
            self.op,
            self.req,
            b.pid,
            self.seq,
            self.wall,
            b.poff,
            b.pages,
            b.doff,
            b.digests,
            b.hoff,
            b.hashes,
            self.fast.tenant_code,
            self.fast.tenant_ord,
            self.allow_sharing,
            self.hit,
            *slot.shares,
            slot.pool is not None,
            *slot.arrays,
            self.freed,
        )
        if nfreed:  # one copy of the released lists (the batch's buffer is reused), then a view per release
            rows = self.freed[:nfreed]
            starts, lengths = b.poff[rows], b.poff[rows + 1] - b.poff[rows]
            ends = np.cumsum(lengths)
            flat = np.empty(int(ends[-1]), b.pages.dtype)
            K.copy_lists(b.pages, starts, lengths, flat)
            assert slot.pool is not None, "the kernel released pages of a node without a pool"
            slot.pool.remember_releases(self.req[rows], flat, ends)
        return stop
