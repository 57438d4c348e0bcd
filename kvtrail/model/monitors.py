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

from kvtrail.model.pool import FREE, NEVER, NO_HASH, UNKNOWN, Pool, Violation
from kvtrail.model.properties import PROPERTIES

__all__ = ["COLUMNS", "Monitors", "Violation", "judge_order"]

_SCALARS = (
    "kind",
    "cluster",
    "node",
    "instance",
    "seq",
    "wall_ns",
    "request_id",
    "tenant_id",
    "purpose",
    "source",
    "num_tokens",
    "status",
    "is_last_chunk",
)
(K_KIND, K_CLUSTER, K_NODE, K_INSTANCE, K_SEQ, K_WALL_NS, K_REQUEST_ID, K_TENANT_ID, K_PURPOSE, K_SOURCE) = range(10)
K_NUM_TOKENS, K_STATUS, K_IS_LAST_CHUNK, K_PAGES, K_ROW = range(10, 15)
COLUMNS = (*_SCALARS, "block_hashes")  # what the monitors read of an event, besides its pages
Event = tuple  # one event as the monitors hold it: the scalars of _SCALARS, its pages, its row
_GONE = np.iinfo(np.int64).max  # the last-seen time of a request code not in use


def _column(table: pa.Table, name: str, type_: pa.DataType) -> pa.ChunkedArray:
    """A column of ``table``; all null when the batch leaves it out (a producer's wire batch may)."""
    if name in table.column_names:
        return table.column(name)
    return pa.chunked_array([pa.nulls(table.num_rows, type_)])


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, list[bool]]:
    """A list column as (flat values, offsets from 0, row is not null)."""
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if not len(arr):
        return np.zeros(0, np.int64), np.zeros(1, np.int64), []
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)
    if offsets[0]:  # a slice: its values start part-way
        values = values[offsets[0] : offsets[-1]]
        offsets = offsets - offsets[0]
    return values.astype(np.int64, copy=False), offsets, arr.is_valid().to_pylist()


def _row_max(values: np.ndarray, offsets: np.ndarray) -> list[int]:
    """Per row, the largest value of its list (-1 for an empty or null one), in one pass."""
    out = np.full(len(offsets) - 1, -1, np.int64)
    starts = offsets[:-1]
    full = np.flatnonzero(offsets[1:] > starts)
    if len(full):
        out[full] = np.maximum.reduceat(values, starts[full])
    return out.tolist()


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


class Monitors:
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
        # of the table being fed: each row's largest page id, the rows whose page list may repeat a page,
        # the block hashes (flat values, offsets, row not null)
        self._maxes: list[int] = []
        self._repeats: set[int] = set()
        self._hash_lists: tuple = (np.zeros(0, np.int64), [0], [])

    def _code(self, e: Event) -> int:
        rid, tenant = e[K_REQUEST_ID], e[K_TENANT_ID]
        c = self.codes.get(rid)
        if c is None:
            if self._spare:
                c = self._spare.pop()
                self.names[c], self.tenants[c], self.last_ns[c] = rid, tenant, e[K_WALL_NS]
            else:
                c = len(self.names)
                self.names.append(rid)
                self.tenants.append(tenant)
                self.last_ns.append(e[K_WALL_NS])
            self.codes[rid] = c
            return c
        if tenant is not None and self.tenants[c] is None:
            self.tenants[c] = tenant
        if e[K_WALL_NS] > self.last_ns[c]:
            self.last_ns[c] = e[K_WALL_NS]
        return c

    # ---- feeding ---------------------------------------------------------------------------------

    def feed(self, table: pa.Table, order: list[int] | None = None) -> None:
        """Judge one table of events, in ``order`` (row numbers; default: as they come).

        What can be done for the whole table at once is (the columns to Python rows, each page list's
        largest id, which lists may repeat a page); what is left per event is the pools' own steps."""
        rows = list(zip(*(_column(table, c, pa.null()).to_pylist() for c in _SCALARS)))
        values, offsets, valid = _flat(_column(table, "pages", pa.list_(pa.int64())))
        # an event is its row's scalars (``K_*``), then its pages (``K_PAGES``) and row number (``K_ROW``)
        hvalues, hoffsets, hvalid = _flat(_column(table, "block_hashes", pa.list_(pa.int64())))
        self._maxes = _row_max(values, offsets)
        self._repeats = _maybe_repeating(values, offsets)
        self._hash_lists = (hvalues, hoffsets.tolist(), hvalid)
        offs = offsets.tolist()
        handlers = {k: getattr(self, "on_" + k) for k in _HANDLED}
        for n in range(table.num_rows) if order is None else order:
            row = rows[n]
            handler = handlers.get(row[0])
            if handler is None:
                continue
            handler(row + ((values[offs[n] : offs[n + 1]] if valid[n] else None), n))
        self.events += table.num_rows

    def _hashes(self, e: Event) -> np.ndarray | None:
        values, offs, valid = self._hash_lists
        n = e[K_ROW]
        return values[offs[n] : offs[n + 1]] if valid[n] else None

    def _pool(self, e: Event) -> Pool | None:
        """The event's node's pool (None before the node's first config)."""
        return self.pools.get((e[K_CLUSTER], e[K_NODE]))

    def _slots(self, pool: Pool, e: Event) -> np.ndarray:
        """Where the event's pages live in the pool's arrays."""
        return pool.slots(e[K_PAGES], self._maxes[e[K_ROW]])

    def _report(self, prop: str, e: Event, detail: str, key=None) -> None:
        if self.from_ns is not None and e[K_WALL_NS] < self.from_ns:
            return
        key = (prop, key if key is not None else (e[K_REQUEST_ID], e[K_NODE]))
        if key in self.reported:
            return
        self.reported.add(key)
        producer = f"{e[K_CLUSTER]}/{e[K_NODE]}/{e[K_INSTANCE]}"
        self.violations.append(Violation(prop, producer, e[K_SEQ], e[K_NODE], e[K_REQUEST_ID], detail, e[K_WALL_NS]))

    def _unknown(self, prop: str, why: str, e: Event) -> None:
        seen = self.cannot_tell.get((prop, why))
        if seen is None:
            self.cannot_tell[(prop, why)] = [1, e]
            return
        seen[0] += 1
        first = seen[1]  # the earliest in the judge's order, whichever order the nodes were fed in
        if (e[K_WALL_NS], e[K_CLUSTER], e[K_NODE], e[K_INSTANCE], e[K_SEQ]) < (
            first[K_WALL_NS],
            first[K_CLUSTER],
            first[K_NODE],
            first[K_INSTANCE],
            first[K_SEQ],
        ):
            seen[1] = e

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

    # ---- handlers --------------------------------------------------------------------------------

    def on_node_config(self, e: Event) -> None:
        key = (e[K_CLUSTER], e[K_NODE])
        if self.instance_of.get(key) != e[K_INSTANCE]:
            self.instance_of[key] = e[K_INSTANCE]
            self.pools[key] = Pool()  # a new producer instance: a fresh pool

    def on_request_received(self, e: Event) -> None:
        self._code(e)

    def on_request_aborted(self, e: Event) -> None:
        self.stopped.setdefault((e[K_CLUSTER], e[K_NODE], self._code(e)), e)

    def on_pages_allocated(self, e: Event) -> None:
        pool = self._pool(e)
        if pool is None:
            return
        rid, pages = e[K_REQUEST_ID], e[K_PAGES]
        code = self._code(e)
        if e[K_PURPOSE] == "prefix_hit":
            hashes = self._hashes(e)
            for k, p in enumerate(pages.tolist()):
                pool.hits.setdefault(p, {})[code] = None if hashes is None else int(hashes[k])
            return
        ix = self._slots(pool, e)
        cur = pool.owner[ix]
        clash = (cur != FREE) & (cur != code)
        if e[K_ROW] in self._repeats and len(np.unique(pages)) != len(pages):
            self._report("pages_conserved", e, f"one allocation lists a page twice: {pages.tolist()}")
        if clash.any():
            for k in np.flatnonzero(clash).tolist():
                p, other = int(pages[k]), int(cur[k])
                self._report("pages_conserved", e, f"page {p} allocated to {rid} while {self.names[other]} holds it")
                pool.extra.setdefault(p, []).append(other)
        pool.owner[ix] = code
        if e[K_PURPOSE] == "decode_growth":
            pool.writer[ix] = code  # the step that reads it fills it
            pool.whash[ix] = NO_HASH

    def on_pages_freed(self, e: Event) -> None:
        pool = self._pool(e)
        if pool is None:
            return
        pages, ix = e[K_PAGES], self._slots(pool, e)
        if e[K_REQUEST_ID] is None:  # a radix eviction releases every holder
            pool.owner[ix] = FREE
            if pool.hits or pool.extra:
                for p in pages.tolist():
                    pool.hits.pop(p, None)
                    pool.extra.pop(p, None)  # every holder released
            return
        code = self._code(e)
        mine = pool.owner[ix] == code
        freed = pages[mine]
        if not mine.all():
            more = []
            for p in pages[~mine].tolist():
                if code in pool.extra.get(p, ()):
                    pool.extra[p].remove(code)
                    if not pool.extra[p]:
                        del pool.extra[p]
                    more.append(p)
                elif code in pool.hits.get(p, ()):
                    del pool.hits[p][code]
                    more.append(p)
            freed = np.concatenate([freed, np.asarray(more, dtype=freed.dtype)])
        pool.owner[ix[mine]] = FREE
        if pool.extra:  # a second owner still holds the page: it becomes the owner
            for p in set(pool.extra).intersection(pages[mine].tolist()):
                pool.owner[pool.slot(p)] = pool.extra[p].pop()
                if not pool.extra[p]:
                    del pool.extra[p]
        if len(freed):
            pool.freed.setdefault(code, []).append((freed, e))

    def on_kv_written(self, e: Event) -> None:
        pool = self._pool(e)
        if pool is None:
            return
        pages, ix = e[K_PAGES], self._slots(pool, e)
        code = self._code(e)
        if e[K_SOURCE] == "transfer_in" and code in pool.freed:
            for k in np.flatnonzero(~pool.held_mask(ix, pages, code)).tolist():
                p = int(pages[k])
                free = pool.freed_by(code, p)
                if free is not None:
                    rid = e[K_REQUEST_ID]
                    self._report(
                        "no_free_before_drain",
                        free,
                        f"{rid}'s write landed on page {p} after {rid} freed it (seq {e[K_SEQ]} of {e[K_NODE]})",
                    )
                    break
        pool.writer[ix] = code
        hashes = self._hashes(e)
        pool.whash[ix] = NO_HASH if hashes is None else hashes

    def on_transfer_received(self, e: Event) -> None:
        code = self._code(e)
        if e[K_STATUS] == "unverified":
            pool = self._pool(e)
            if pool is not None and e[K_PAGES] is not None:
                pool.writer[self._slots(pool, e)] = UNKNOWN  # writer unknown from now on
            return
        if e[K_STATUS] in ("ok", "mismatch"):
            self.received[(e[K_CLUSTER], e[K_NODE], code)] = (e[K_NUM_TOKENS], e)

    def on_transfer_reserved(self, e: Event) -> None:
        self.reserved[(e[K_CLUSTER], e[K_NODE], self._code(e))] = e[K_NUM_TOKENS]

    def on_transfer_sent(self, e: Event) -> None:
        code = self._code(e)
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

    def on_kv_read(self, e: Event) -> None:
        pool = self._pool(e)
        if pool is None:
            return
        rid, pages = e[K_REQUEST_ID], e[K_PAGES]
        code = self._code(e)
        ix = self._slots(pool, e)
        writers = pool.writer[ix]
        own = pool.owner[ix] == code
        if own.all() and (writers == code).all():
            bad: list[int] = []  # its own pages, written by itself: the common case
        else:
            held = pool.held_mask(ix, pages, code)
            bad = np.flatnonzero(~held | (writers != code)).tolist()
        tenant = self.tenants[code]
        for k in bad:
            p = int(pages[k])
            if not held[k]:
                self._report("no_foreign_read", e, f"{rid} reads page {p} it does not hold")
                break
            w = int(writers[k])
            if w == NEVER:
                self._report("no_foreign_read", e, f"{rid} reads page {p}, never written since the pool began")
                break
            if w == UNKNOWN:
                self._unknown("no_foreign_read", "a read of pages an unverified transfer may have written", e)
                continue
            hit = pool.hits.get(p, {}).get(code)
            whash = int(pool.whash[ix[k]])
            wtenant = self.tenants[w]
            if hit is not None and hit == whash and wtenant == tenant:
                continue  # a sealed prefix of its own namespace
            why = "a prefix of another namespace" if hit is not None and hit == whash else "last written"
            self._report("no_foreign_read", e, f"{rid} ({tenant}) reads page {p}: {why} by {self.names[w]} ({wtenant})")
            break
        key = (e[K_CLUSTER], e[K_NODE], code)
        if key in self.reserved:
            want = self.reserved[key]
            got = self.received.get(key)
            if got is None:
                self._unknown("transferred_equals_reserved", "decode read with no receipt of the transfer", e)
            elif got[0] != want:
                sent = self.sent.get(code)
                self._report(
                    "transferred_equals_reserved",
                    got[1],
                    f"decode committed {rid}: {want} tokens reserved, {sent and sent[0]} sent, {got[0]} landed",
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


_HANDLED = tuple(name[3:] for name in vars(Monitors) if name.startswith("on_"))


def judge_order(table: pa.Table) -> list[int]:
    """Row numbers in the judge's order: wall time, then cluster, node, instance, seq."""
    keys = [(c, "ascending") for c in ("wall_ns", "cluster", "node", "instance", "seq")]
    return pc.sort_indices(table.select([k for k, _ in keys]), sort_keys=keys).to_pylist()


assert set(PROPERTIES) >= {"no_foreign_read", "aborted_never_sent", "no_free_before_drain"}
