"""The model's properties as monitors over a recorded history (``kvtrail model validate``).

Events are fed in the judge's order (wall time, then cluster, node, instance and each producer's seq).
Each node's pool is its own, started afresh by a ``node_config`` of a new producer instance (a
restart); page events before a node's first ``node_config`` are not judged. A violation names its
property, the first event that shows it (``producer:seq``, node, request) and what was seen. Where the
record cannot show what a property needs, the monitors say so as coverage ("cannot tell"), never as a
pass.

How each property reads a history:
- ``no_foreign_read``: a ``kv_read`` by R of a page whose last write was not R's, unless R holds it as a
  prefix hit whose block hash is the one its writer stored, written by R's own tenant (namespace); a page
  R does not hold is not R's to read either. A page given to R for decode growth counts as R's. A page an
  ``unverified`` receipt may have written has an unknown writer: cannot tell.
- ``aborted_never_sent``: a ``transfer_sent`` for R on a node that already recorded R rejected or aborted.
- ``no_free_before_drain``: R's write lands (``kv_written`` from ``transfer_in``) on a page R does not hold
  and freed before: the free came before the drain; the first offending event is R's latest free of it
  (every free of R is kept while R is in flight, not only each page's last freer: see ``Pool``).
- ``transferred_equals_reserved``: decode reads for R after a receipt for R whose tokens differ from what
  decode reserved, or R's sends total other than the reservation (more than it, or a different total once
  the sender's last chunk is recorded, whichever node's events come first); a read with a
  reservation and no receipt: cannot tell.
- ``pages_conserved``: a page allocated (not as a prefix hit) while another request holds it, or listed
  twice in one allocation.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.model.pagekernel import (
    OP_ALLOC,
    OP_EVICT,
    OP_FREE,
    OP_GROWTH,
    OP_PREFIX,
    OP_READ,
    OP_UNVERIFIED,
    OP_WRITE,
    OP_WRITE_IN,
)
from kvtrail.model.pagesteps import (
    _SCALARS,
    COLUMNS,
    K_CLUSTER,
    K_INSTANCE,
    K_IS_LAST_CHUNK,
    K_KIND,
    K_NODE,
    K_NUM_TOKENS,
    K_PURPOSE,
    K_REQUEST_ID,
    K_SEQ,
    K_SOURCE,
    K_STATUS,
    K_TENANT_ID,
    K_WALL_NS,
    Event,
    PageSteps,
)
from kvtrail.model.pool import Pool, Violation
from kvtrail.model.properties import PROPERTIES

__all__ = ["COLUMNS", "Monitors", "Violation", "judge_order"]

_ALLOC_OPS = {"prefix_hit": OP_PREFIX, "decode_growth": OP_GROWTH}
_GONE = np.iinfo(np.int64).max  # the last-seen time of a request code not in use


def _column(table: pa.Table, name: str, type_: pa.DataType) -> pa.ChunkedArray:
    """A column of ``table``; all null when the batch leaves it out (a producer's wire batch may)."""
    if name in table.column_names:
        return table.column(name)
    return pa.chunked_array([pa.nulls(table.num_rows, type_)])


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A list column as (flat int64 values, offsets from 0, row is not null), each read-only (so the
    compiled steps see one type of array whichever way Arrow handed them over)."""
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if not len(arr):
        values, offsets, valid = np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, bool)
    else:
        offsets = arr.offsets.to_numpy()
        values = arr.values.to_numpy(zero_copy_only=False)
        if offsets[0]:  # a slice: its values start part-way
            values = values[offsets[0] : offsets[-1]]
            offsets = offsets - offsets[0]
        values = values.astype(np.int64, copy=False)
        offsets = offsets.astype(np.int64, copy=False)
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
    for a in (values, offsets, valid):
        a.setflags(write=False)
    return values, offsets, valid


def _row_max(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per row, the largest value of its list (-1 for an empty or null one), in one pass."""
    out = np.full(len(offsets) - 1, -1, np.int64)
    starts = offsets[:-1]
    full = np.flatnonzero(offsets[1:] > starts)
    if len(full):
        out[full] = np.maximum.reduceat(values, starts[full])
    return out


def _maybe_repeating(values: np.ndarray, offsets: np.ndarray) -> set[int]:
    """Rows whose page list is not strictly increasing (the only ones that can list a page twice)."""
    if len(values) < 2:
        return set()
    starts = np.zeros(len(values), bool)
    lengths = np.diff(offsets)
    starts[offsets[:-1][lengths > 0]] = True
    pairs = np.flatnonzero((values[1:] <= values[:-1]) & ~starts[1:])  # (j, j+1) within one row
    if not len(pairs):
        return set()
    return set((np.searchsorted(offsets, pairs + 1, side="right") - 1).tolist())


class Monitors(PageSteps):
    """The five monitors over one history; ``from_ns``: violations before it are not reported (the
    history before it is still replayed, so the pools' state at ``from_ns`` is right)."""

    def __init__(self, from_ns: int | None = None):
        self.from_ns = from_ns
        self.pools: dict[tuple, Pool] = {}
        self.instance_of: dict[tuple, str] = {}
        # per (cluster, node, request code): the abort event, the tokens reserved, the receipt (tokens, event)
        self.stopped: dict[tuple, Event] = {}
        self.reserved: dict[tuple, int] = {}
        self.received: dict[tuple, tuple[int, Event]] = {}
        self.sent: dict[int, list] = {}  # request code -> [tokens sent, last chunk seen]
        self.pending: dict[int, list[tuple[int, tuple[int, Event]]]] = {}  # code -> (reserved, receipt) of reads
        self.codes: dict[str, int] = {}
        self.names: list[str | None] = []
        self.tenants: list[str | None] = []
        self.last_ns: list[int] = []  # per code, the wall time of its latest event
        self._spare: list[int] = []  # codes of pruned requests, to reuse
        self.violations: list[Violation] = []
        self.reported: set = set()
        self.cannot_tell: dict[tuple[str, str], list] = {}  # -> [events, the first of them]
        self.events = 0
        # of the table being fed: its rows, page lists (flat values, offsets as a list), each row's largest
        # page id, the rows whose page list may repeat a page, the block hashes (flat values, offsets, row
        # not null); per code, the position from which its tenant is known (set within this table)
        self._rows: list[tuple] = []
        self._values = np.zeros(0, np.int64)
        self._offs: list[int] = [0]
        self._valid = np.zeros(0, bool)
        self._maxes: list[int] = []
        self._repeats: set[int] = set()
        self._hash_lists: tuple = (np.zeros(0, np.int64), [0], np.zeros(0, bool))
        self._tenant_from: dict[int, int] = {}
        # the reports of the table being fed, ordered as one pass in order would make them (``_flush``):
        # (position, 0 for a page step or 1 for the rest), a running number
        self._found: list[tuple] = []
        self._at: tuple[int, int] = (0, 0)

    def _code(self, row: tuple, pos: int) -> int:
        rid, tenant = row[K_REQUEST_ID], row[K_TENANT_ID]
        c = self.codes.get(rid)
        if c is None:
            if self._spare:
                c = self._spare.pop()
                self.names[c], self.tenants[c], self.last_ns[c] = rid, tenant, row[K_WALL_NS]
            else:
                c = len(self.names)
                self.names.append(rid)
                self.tenants.append(tenant)
                self.last_ns.append(row[K_WALL_NS])
            self.codes[rid] = c
            return c
        if tenant is not None and self.tenants[c] is None:
            self.tenants[c] = tenant
            self._tenant_from[c] = pos
        if row[K_WALL_NS] > self.last_ns[c]:
            self.last_ns[c] = row[K_WALL_NS]
        return c

    # ---- feeding ---------------------------------------------------------------------------------

    def feed(self, table: pa.Table, order: list[int] | None = None) -> None:
        """Judge one table of events, in ``order`` (row numbers; default: as they come).

        One pass in order gives each event its request's code and runs what is not a page step (aborts,
        reservations, receipts, sends, what a read is owed by its reservation); then each pool's page steps
        run in order, the common ones compiled (:func:`~kvtrail.model.pagekernel.run_pages`), the rest in
        Python. Pools are apart and the page steps read nothing the first pass writes but a request's
        tenant (taken as known at the step's position), so this judges as one pass over the events would;
        reports are put in that pass's order before the first of each is kept (``_flush``)."""
        self._rows = rows = list(zip(*(_column(table, c, pa.null()).to_pylist() for c in _SCALARS)))
        values, offsets, valid = _flat(_column(table, "pages", pa.list_(pa.int64())))
        hvalues, hoffsets, hvalid = _flat(_column(table, "block_hashes", pa.list_(pa.int64())))
        maxes = _row_max(values, offsets)
        self._values, self._offs, self._valid, self._maxes = values, offsets.tolist(), valid, maxes.tolist()
        self._repeats = _maybe_repeating(values, offsets)
        self._hash_lists = (hvalues, hoffsets.tolist(), hvalid)
        self._tenant_from = {}
        steps: dict[int, tuple[Pool, list, list, list, list]] = {}  # per pool: rows, positions, codes, ops
        pools = self.pools
        for pos, n in enumerate(range(table.num_rows) if order is None else order):
            row = rows[n]
            kind = row[K_KIND]
            if kind in _PAGE_KINDS:
                key = (row[K_CLUSTER], row[K_NODE])
                pool = pools.get(key)
                if pool is None:
                    continue
                if kind == "pages_freed" and row[K_REQUEST_ID] is None:
                    code, op = -1, OP_EVICT
                else:
                    code = self._code(row, pos)
                    if kind == "kv_written":
                        op = OP_WRITE_IN if row[K_SOURCE] == "transfer_in" else OP_WRITE
                    elif kind == "pages_allocated":
                        op = _ALLOC_OPS.get(row[K_PURPOSE], OP_ALLOC)
                    elif kind == "kv_read":
                        op = OP_READ
                        if key + (code,) in self.reserved:
                            self._at = (pos, 1)
                            self._read_reserved(self._event(n, code, pos), code)
                    else:
                        op = OP_FREE
                s = steps.get(id(pool))
                if s is None:
                    s = steps[id(pool)] = (pool, [], [], [], [])
                s[1].append(n)
                s[2].append(pos)
                s[3].append(code)
                s[4].append(op)
            elif kind in _OTHER_KINDS:
                if kind == "node_config":
                    self.on_node_config(row)
                    continue
                code = self._code(row, pos)
                self._at = (pos, 1)
                if kind == "transfer_received" and row[K_STATUS] == "unverified":
                    key = (row[K_CLUSTER], row[K_NODE])
                    pool = pools.get(key)
                    if pool is not None and valid[n]:
                        s = steps.get(id(pool))
                        if s is None:
                            s = steps[id(pool)] = (pool, [], [], [], [])
                        s[1].append(n)
                        s[2].append(pos)
                        s[3].append(code)
                        s[4].append(OP_UNVERIFIED)
                else:
                    step = _OTHER_KINDS[kind]
                    if step is not None:
                        step(self, self._event(n, code, pos), code)
        for pool, ns, poss, codes, ops in steps.values():
            self._run_pool(pool, ns, poss, codes, ops, maxes, hvalues, hoffsets, hvalid)
        self._flush()
        self.events += table.num_rows

    def prune(self, before_ns: int) -> int:
        """Forget requests with no event since ``before_ns`` that no page refers to any more (their aborts,
        reservations, receipts, sends and frees; their codes are reused). Returns how many were dropped.
        A write of such a request landing later is not recognised as late: the horizon is the caller's."""
        last = np.asarray(self.last_ns, np.int64)
        old = set(np.flatnonzero(last < before_ns).tolist())
        if not old:
            return 0
        for pool in self.pools.values():
            old -= pool.codes()
        if not old:
            return 0
        for c in old:
            name = self.names[c]
            assert name is not None, "model: a pruned code is not in use"
            del self.codes[name]
            self.names[c] = self.tenants[c] = None
            self.last_ns[c] = _GONE
            self.sent.pop(c, None)
            self.pending.pop(c, None)
            for pool in self.pools.values():
                pool.freed.pop(c, None)
        self._spare.extend(old)
        for d in (self.stopped, self.reserved, self.received):
            for k in [k for k in d if k[2] in old]:
                del d[k]
        return len(old)

    # ---- steps -----------------------------------------------------------------------------------

    def on_node_config(self, row: tuple) -> None:
        key = (row[K_CLUSTER], row[K_NODE])
        if self.instance_of.get(key) != row[K_INSTANCE]:
            self.instance_of[key] = row[K_INSTANCE]
            self.pools[key] = Pool()  # a new producer instance: a fresh pool

    def on_request_aborted(self, e: Event, code: int) -> None:
        self.stopped.setdefault((e[K_CLUSTER], e[K_NODE], code), e)

    def on_transfer_received(self, e: Event, code: int) -> None:
        if e[K_STATUS] in ("ok", "mismatch"):  # an unverified one is a page step (``_unverified``)
            self.received[(e[K_CLUSTER], e[K_NODE], code)] = (e[K_NUM_TOKENS], e)

    def on_transfer_reserved(self, e: Event, code: int) -> None:
        self.reserved[(e[K_CLUSTER], e[K_NODE], code)] = e[K_NUM_TOKENS]

    def on_transfer_sent(self, e: Event, code: int) -> None:
        sent = self.sent.setdefault(code, [0, False])
        sent[0] += e[K_NUM_TOKENS] or 0
        sent[1] = sent[1] or bool(e[K_IS_LAST_CHUNK])
        stop = self.stopped.get((e[K_CLUSTER], e[K_NODE], code))
        if stop is not None:
            self._report(
                "aborted_never_sent",
                e,
                f"{e[K_NODE]} sends {e[K_REQUEST_ID]}'s KV after recording it aborted at {stop[K_NODE]}:{stop[K_SEQ]}",
            )
        for want, got in self.pending.get(code, ()):
            self._check_sent(code, want, got)

    def _check_sent(self, code: int, want: int, got: tuple[int, Event]) -> bool:
        """A read's reservation against the sends of its request: False once they differ (reported)."""
        sent = self.sent.get(code)
        if sent is None or not (sent[0] > want or sent[1] and sent[0] != want):
            return True
        self._report(
            "transferred_equals_reserved",
            got[1],
            f"decode committed {self.names[code]}: {want} tokens reserved, {sent[0]} sent, {got[0]} landed",
        )
        return False

    def _read_reserved(self, e: Event, code: int) -> None:
        """What a read on a node that reserved for its request is owed: the receipt, and its tokens."""
        key = (e[K_CLUSTER], e[K_NODE], code)
        want = self.reserved[key]
        got = self.received.get(key)
        if got is None:
            self._unknown("transferred_equals_reserved", "decode read with no receipt of the transfer", e)
        elif got[0] != want:
            sent = self.sent.get(code)
            self._report(
                "transferred_equals_reserved",
                got[1],
                f"decode committed {e[K_REQUEST_ID]}: {want} tokens reserved, {sent and sent[0]} sent, {got[0]} landed",
            )
        elif self._check_sent(code, want, got):  # the sends may come later (another node's batch)
            self.pending.setdefault(code, []).append((want, got))

    # ---- result ----------------------------------------------------------------------------------

    def coverage(self) -> list[dict]:
        out = []
        for (prop, why), (n, e) in sorted(self.cannot_tell.items()):
            out.append(
                {
                    "property": prop,
                    "cannot_tell": why,
                    "events": n,
                    "first_event": {
                        "producer": f"{e[K_CLUSTER]}/{e[K_NODE]}/{e[K_INSTANCE]}",
                        "seq": e[K_SEQ],
                        "node": e[K_NODE],
                        "request_id": e[K_REQUEST_ID],
                    },
                }
            )
        return out


_PAGE_KINDS = frozenset(("pages_allocated", "pages_freed", "kv_written", "kv_read"))
# the other kinds the monitors read, each with its step (``request_received`` only names its request)
_OTHER_KINDS = {
    "node_config": None,
    "request_received": None,
    "request_aborted": Monitors.on_request_aborted,
    "transfer_received": Monitors.on_transfer_received,
    "transfer_reserved": Monitors.on_transfer_reserved,
    "transfer_sent": Monitors.on_transfer_sent,
}


def judge_order(table: pa.Table) -> list[int]:
    """Row numbers in the judge's order: wall time, then cluster, node, instance, seq."""
    keys = [(c, "ascending") for c in ("wall_ns", "cluster", "node", "instance", "seq")]
    return pc.sort_indices(table.select([k for k, _ in keys]), sort_keys=keys).to_pylist()


assert set(PROPERTIES) >= {"no_foreign_read", "aborted_never_sent", "no_free_before_drain"}
