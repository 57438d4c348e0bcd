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

from kvtrail.audit.arrowutil import filled, valid_mask
from kvtrail.keys import unique_first
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
    K_NODE,
    K_NUM_TOKENS,
    K_REQUEST_ID,
    K_SEQ,
    K_STATUS,
    Event,
    PageSteps,
)
from kvtrail.model.pool import Pool, Violation
from kvtrail.model.properties import PROPERTIES
from kvtrail.model.rows import Rows

__all__ = ["COLUMNS", "Monitors", "Violation", "judge_order"]

_ALLOC_OPS = {"prefix_hit": OP_PREFIX, "decode_growth": OP_GROWTH}
_GONE = np.iinfo(np.int64).max  # the last-seen time of a request code not in use


def _column(table: pa.Table, name: str, type_: pa.DataType) -> pa.ChunkedArray:
    """A column of ``table``; all null when the batch leaves it out (a producer's wire batch may)."""
    if table.schema.get_field_index(name) >= 0:
        return table.column(name)
    return pa.chunked_array([pa.nulls(table.num_rows, type_)])


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A list column as (flat values, offsets from 0, row is not null), each read-only (so the compiled
    steps see one type of array whichever way Arrow handed them over). Values are int32 where the column
    holds int32 (the audit schema's page ids: a commit's ~600,000 are not copied into a wider array),
    else int64; offsets are int64."""
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if not len(arr):
        values, offsets, valid = np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, bool)
    else:
        offsets = arr.offsets.to_numpy()
        values = arr.values.to_numpy(zero_copy_only=False)
        if offsets[0]:  # a slice: its values start part-way
            values = values[offsets[0] : offsets[-1]]
            offsets = offsets - offsets[0]
        values = values.astype(np.int32 if values.dtype == np.int32 else np.int64, copy=False)
        offsets = offsets.astype(np.int64, copy=False)
        valid = valid_mask(arr)
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


def _indices(table: pa.Table, name: str, fixed: tuple | None = None) -> tuple[np.ndarray, list]:
    """A string column as (per row, an index into the distinct values, -1 for null; the values); with
    ``fixed``, the index into ``fixed`` (-1 for null or a value not in it)."""
    col = _column(table, name, pa.string())
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    d = arr if pa.types.is_dictionary(arr.type) else pc.dictionary_encode(arr)
    idx = filled(d.indices, -1).astype(np.int64)
    values = d.dictionary.to_pylist()
    if fixed is None:
        return idx, values
    lut = np.asarray([fixed.index(v) if v in fixed else -1 for v in values] + [-1], np.int64)
    return lut[idx], list(fixed)


def _equals(table: pa.Table, name: str, word: str) -> np.ndarray:
    """Per row, whether the string column ``name`` holds ``word``."""
    col = _column(table, name, pa.string())
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if pa.types.is_dictionary(arr.type):  # compared once per distinct value
        hit = np.array([v == word for v in arr.dictionary.to_pylist()] + [False])
        return hit[filled(arr.indices, -1)]
    return filled(pc.equal(arr, word), False)


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
        self.codes: dict[str | None, int] = {}
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
        self._rows = Rows()
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

    # ---- feeding ---------------------------------------------------------------------------------

    def feed(self, table: pa.Table, order: list[int] | None = None) -> None:
        """Judge one table of events, in ``order`` (row numbers; default: as they come).

        Per table: each event's pool (a ``node_config`` of a new instance starts one) and request code, as
        one pass in order would give them; then, in order, what is not a page step (aborts, reservations,
        receipts, sends, what a read is owed by its reservation); then each pool's page steps in order, the
        common ones compiled (:func:`~kvtrail.model.pagekernel.run_pages`), the rest in Python. Pools are
        apart and the page steps read nothing the other steps write but a request's tenant (taken as known
        at the step's position), so this judges as one pass over the events would; reports are put in that
        pass's order before the first of each is kept (``_flush``)."""
        n_rows = table.num_rows
        self._rows = Rows(table, _SCALARS)
        values, offsets, valid = _flat(_column(table, "pages", pa.list_(pa.int64())))
        hvalues, hoffsets, hvalid = _flat(_column(table, "block_hashes", pa.list_(pa.int64())))
        maxes = _row_max(values, offsets)
        self._values, self._offs, self._valid, self._maxes = values, offsets.tolist(), valid, maxes.tolist()
        self._repeats = _maybe_repeating(values, offsets)
        self._hash_lists = (hvalues, hoffsets.tolist(), hvalid)
        self._tenant_from = {}
        at = np.arange(n_rows, dtype=np.int64) if order is None else np.asarray(order, np.int64)
        kind = _indices(table, "kind", _KINDS)[0][at]  # per position: index in _KINDS, -1 for a kind not read
        pool_at, pools, (cluster_at, clusters, node_at, nodes) = self._pools_at(table, at, kind)
        rid, rid_names = _indices(table, "request_id")
        rid = rid[at]
        is_page = (kind >= 0) & (kind < _KINDS.index("node_config"))
        freed = kind == _KINDS.index("pages_freed")
        # the events that name their request (each of the other kinds; a page event on a node with a pool,
        # but a radix eviction)
        names = (~is_page & (kind > _KINDS.index("node_config"))) | (is_page & (pool_at >= 0) & ~(freed & (rid < 0)))
        code = self._codes_at(table, at, names, rid, rid_names)
        # page steps: per position its step (-1 for none)
        op = np.full(len(at), -1, np.int8)
        for k, page_op in _PAGE_OPS.items():
            op[kind == _KINDS.index(k)] = page_op
        for k, col, word, page_op in _OP_WORDS:
            op[(kind == _KINDS.index(k)) & _equals(table, col, word)[at]] = page_op
        op[freed & (rid < 0)] = OP_EVICT
        op[pool_at < 0] = -1
        op[(kind == _KINDS.index("transfer_received")) & ~valid[at]] = -1
        # the other steps, in order (a read's only if it is on a node with a pool, and only while some
        # request has a reservation); their rows' values made at once
        reserved, read = self.reserved, _KINDS.index("kv_read")
        other = names & ~is_page & (kind > _KINDS.index("request_received"))
        self._rows.fetch(at[np.flatnonzero(other)])
        if reserved or (kind == _KINDS.index("transfer_reserved")).any():
            other |= names & (kind == read)  # a read's key is looked up by name, its row made only if reserved
        codes, ats, kinds = code.tolist(), at.tolist(), kind.tolist()
        cl_at, nd_at, cl_names, nd_names = cluster_at.tolist(), node_at.tolist(), [*clusters, None], [*nodes, None]
        for pos in np.flatnonzero(other).tolist():
            n, c = ats[pos], codes[pos]
            self._at = (pos, 1)
            if kinds[pos] == read:
                key = (cl_names[cl_at[pos]], nd_names[nd_at[pos]], c)
                if key in reserved:
                    self._read_reserved(n, pos, key)
            else:
                _OTHER_STEPS[_KINDS[kinds[pos]]](self, n, pos, c)
        for i, pool in enumerate(pools):
            sel = np.flatnonzero((pool_at == i) & (op >= 0))
            if len(sel):
                self._run_pool(pool, at[sel], sel, code[sel], op[sel], offsets, maxes, hvalues, hoffsets, hvalid)
        self._flush()
        self._rows = Rows()  # the table's rows are not kept (the events kept are made)
        self.events += n_rows

    def _pools_at(self, table: pa.Table, at: np.ndarray, kind: np.ndarray) -> tuple[np.ndarray, list[Pool], tuple]:
        """Per position, the index (in the returned list) of the pool its node has there (-1 for none):
        the pool the node had before the table, or the one its latest ``node_config`` of a new instance
        started (``on_node_config``, run here in order); and per position the index of its cluster and
        node among the distinct ones (-1: null), with those."""
        cluster, clusters = _indices(table, "cluster")
        node, nodes = _indices(table, "node")
        cluster, node = cluster[at], node[at]
        key = (cluster + 1) * (len(nodes) + 1) + node + 1
        keys, key_at = np.unique(key, return_inverse=True)
        pool_at = np.full(len(at), -1, np.int64)
        pools: list[Pool] = []
        config = np.flatnonzero(kind == _KINDS.index("node_config")).tolist()
        for k, kv in enumerate(keys.tolist()):
            ci, ni = divmod(kv, len(nodes) + 1)
            name = (clusters[ci - 1] if ci else None, nodes[ni - 1] if ni else None)
            mine = np.flatnonzero(key_at == k)
            starts, index = [0], [-1]
            if name in self.pools:
                index[0] = len(pools)
                pools.append(self.pools[name])
            for pos in (p for p in config if key_at[p] == k):
                was = self.pools.get(name)
                self.on_node_config(self._event(int(at[pos]), -1, pos))
                if self.pools.get(name) is not was:
                    starts.append(pos)
                    index.append(len(pools))
                    pools.append(self.pools[name])
            pool_at[mine] = np.asarray(index)[np.searchsorted(starts, mine, side="right") - 1]
        return pool_at, pools, (cluster, clusters, node, nodes)

    def _codes_at(self, table, at, names, rid, rid_names) -> np.ndarray:
        """Per position, the code of its request where ``names`` (else -1), given as one pass in order
        would give them (new codes in order of first sight); each request's latest wall time and its
        tenant, with the position from which the tenant is known (``_tenant``)."""
        code = np.full(len(at), -1, np.int64)
        pos = np.flatnonzero(names)
        if not len(pos):
            return code
        r = rid[pos]
        seen, first, inverse = unique_first(r + 1, len(rid_names) + 1)  # (-1: no request id)
        seen = seen - 1
        wall = _column(table, "wall_ns", pa.int64()).to_numpy(zero_copy_only=False)[at[pos]]
        latest = np.full(len(seen), np.iinfo(np.int64).min, np.int64)
        np.maximum.at(latest, inverse, wall)
        tenant, tenant_names = _indices(table, "tenant_id")
        tenant = tenant[at[pos]]
        has = np.flatnonzero(tenant >= 0)
        tseen, tfirst, _ = unique_first(inverse[has], len(seen))
        order = np.argsort(first, kind="stable")  # the distinct requests in order of first sight
        ext = [*rid_names, None]  # index -1: no request id
        names_l = list(map(ext.__getitem__, seen[order].tolist()))
        latest_l = latest[order].tolist()
        got: list = list(map(self.codes.get, names_l))
        last_ns, spare = self.last_ns, self._spare
        for k, c in enumerate(got):
            if c is not None:
                if latest_l[k] > last_ns[c]:
                    last_ns[c] = latest_l[k]
                continue
            name = names_l[k]
            if spare:
                c = spare.pop()
                self.names[c], self.tenants[c], last_ns[c] = name, None, latest_l[k]
            else:
                c = len(self.names)
                self.names.append(name)
                self.tenants.append(None)
                last_ns.append(latest_l[k])
            self.codes[name] = c
            got[k] = c
        lut = np.empty(len(seen), np.int64)
        lut[order] = got
        tenants, tenant_from = self.tenants, self._tenant_from
        # each request's tenant, from its first event that names one (each code is one request's)
        at_l, t_l = pos[has[tfirst]].tolist(), tenant[has[tfirst]].tolist()
        for c, p, t in zip(lut[tseen].tolist(), at_l, t_l):
            if tenants[c] is None:
                tenants[c] = tenant_names[t]
                tenant_from[c] = p
        code[pos] = lut[inverse]
        return code

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

    # each step of the others reads its event's columns (row ``n``, position ``pos``) and makes the event
    # only to keep it or report it

    def on_request_aborted(self, n: int, pos: int, code: int) -> None:
        row = self._rows[n]
        key = (row[K_CLUSTER], row[K_NODE], code)
        if key not in self.stopped:
            self.stopped[key] = self._event(n, code, pos)

    def on_transfer_received(self, n: int, pos: int, code: int) -> None:
        row = self._rows[n]
        if row[K_STATUS] in ("ok", "mismatch"):  # an unverified one is a page step (``_unverified``)
            e = self._event(n, code, pos)
            self.received[(row[K_CLUSTER], row[K_NODE], code)] = (e[K_NUM_TOKENS], e)

    def on_transfer_reserved(self, n: int, pos: int, code: int) -> None:
        row = self._rows[n]
        self.reserved[(row[K_CLUSTER], row[K_NODE], code)] = row[K_NUM_TOKENS]

    def on_transfer_sent(self, n: int, pos: int, code: int) -> None:
        row = self._rows[n]
        sent = self.sent.setdefault(code, [0, False])
        sent[0] += row[K_NUM_TOKENS] or 0
        sent[1] = sent[1] or bool(row[K_IS_LAST_CHUNK])
        stop = self.stopped.get((row[K_CLUSTER], row[K_NODE], code))
        if stop is not None:
            e = self._event(n, code, pos)
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

    def _read_reserved(self, n: int, pos: int, key: tuple) -> None:
        """What a read (row ``n``) on a node that reserved for its request is owed: the receipt, and its
        tokens; ``key``: (cluster, node, request code) of the reservation."""
        code = key[2]
        want = self.reserved[key]
        got = self.received.get(key)
        if got is None:
            e = self._event(n, code, pos)
            self._unknown("transferred_equals_reserved", "decode read with no receipt of the transfer", e)
        elif got[0] != want:
            sent = self.sent.get(code)
            self._report(
                "transferred_equals_reserved",
                got[1],
                f"decode committed {self.names[code]}: {want} tokens reserved, "
                f"{sent and sent[0]} sent, {got[0]} landed",
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


# the kinds the monitors read: the page kinds first, then node_config, then those that only name a request
_KINDS = (
    "pages_allocated",
    "pages_freed",
    "kv_written",
    "kv_read",
    "node_config",
    "request_received",
    "request_aborted",
    "transfer_received",
    "transfer_reserved",
    "transfer_sent",
)
_PAGE_OPS = {"pages_allocated": OP_ALLOC, "pages_freed": OP_FREE, "kv_written": OP_WRITE, "kv_read": OP_READ}
_OP_WORDS = (  # (kind, column, value, page step)
    ("pages_allocated", "purpose", "prefix_hit", OP_PREFIX),
    ("pages_allocated", "purpose", "decode_growth", OP_GROWTH),
    ("kv_written", "source", "transfer_in", OP_WRITE_IN),
    ("transfer_received", "status", "unverified", OP_UNVERIFIED),
)
# the steps that are not page steps, per kind (a read's: what its reservation is owed)
_OTHER_STEPS = {  # (a request_received names its request and has no step of its own; a read's: _read_reserved)
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
