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
  and was the last to free: the free came before the drain; the first offending event is that free.
- ``transferred_equals_reserved``: decode reads for R after a receipt (or sends) for R whose tokens differ
  from what decode reserved; a read with a reservation and no receipt: cannot tell.
- ``pages_conserved``: a page allocated (not as a prefix hit) while another request holds it, or listed
  twice in one allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.model.properties import PROPERTIES

_COLUMNS = (
    "kind",
    "cluster",
    "node",
    "instance",
    "seq",
    "wall_ns",
    "request_id",
    "tenant_id",
    "pages",
    "purpose",
    "source",
    "num_tokens",
    "status",
    "block_hashes",
)


_LISTS = ("pages", "block_hashes")


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, list[bool]]:
    """A list column as (flat values, offsets, row is not null)."""
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    values = arr.values.to_numpy(zero_copy_only=False) if len(arr) else np.zeros(0, np.int64)
    offsets = arr.offsets.to_numpy()
    if arr.offset or offsets[0]:
        offsets = offsets - offsets[0]
        values = arr.flatten().to_numpy(zero_copy_only=False)
    return values.astype(np.int64, copy=False), offsets, arr.is_valid().to_pylist()


@dataclass
class Violation:
    property: str
    producer: str
    seq: int
    node: str
    request_id: str | None
    detail: str
    wall_ns: int

    def as_dict(self) -> dict:
        return {
            "property": self.property,
            "first_event": {
                "producer": self.producer,
                "seq": self.seq,
                "node": self.node,
                "request_id": self.request_id,
            },
            "detail": self.detail,
        }


NEVER, UNKNOWN, FREE = -1, -2, -1
NO_HASH = np.iinfo(np.int64).min  # the writer stored no block hash


class _Pool:
    """One node's pool as arrays indexed by page id (grown as page ids appear): the exclusive owner's
    request code (a second owner, a fault, kept aside), the last writer and the block hash it stored,
    the last request that freed the page; prefix-cache hits in a dict (page -> {request code: hash})."""

    def __init__(self, size: int = 1024):
        self.owner = np.full(size, FREE, np.int64)
        self.writer = np.full(size, NEVER, np.int64)
        self.whash = np.full(size, NO_HASH, np.int64)
        self.freer = np.full(size, FREE, np.int64)
        self.freed_ev: dict[int, dict] = {}  # page -> the event that freed it last
        self.extra: dict[int, list[int]] = {}  # page -> further exclusive owners (double ownership)
        self.hits: dict[int, dict[int, int | None]] = {}

    def fit(self, pages: np.ndarray) -> None:
        if len(pages) and int(pages.max()) >= len(self.owner):
            size = max(int(pages.max()) + 1, 2 * len(self.owner))
            for name, fill in (("owner", FREE), ("writer", NEVER), ("whash", NO_HASH), ("freer", FREE)):
                old = getattr(self, name)
                grown = np.full(size, fill, np.int64)
                grown[: len(old)] = old
                setattr(self, name, grown)

    def held_mask(self, pages: np.ndarray, code: int) -> np.ndarray:
        held = self.owner[pages] == code
        if not held.all() and (self.extra or self.hits):
            for k in np.flatnonzero(~held):
                p = int(pages[k])
                held[k] = code in self.extra.get(p, ()) or code in self.hits.get(p, ())
        return held


class Monitors:
    """The five monitors over one history; ``from_ns``: violations before it are not reported (the
    history before it is still replayed, so the pools' state at ``from_ns`` is right)."""

    def __init__(self, from_ns: int | None = None):
        self.from_ns = from_ns
        self.pools: dict[tuple, _Pool] = {}
        self.instance_of: dict[tuple, str] = {}
        self.stopped: dict[tuple, dict] = {}  # (node, request) -> the abort event
        self.reserved: dict[tuple, int] = {}  # (node, request) -> tokens decode reserved
        self.received: dict[tuple, tuple[int, dict]] = {}  # (node, request) -> (tokens, event)
        self.sent: dict[str, int] = {}  # request -> tokens prefill sent
        self.codes: dict[str, int] = {}
        self.names: list[str] = []
        self.tenants: list[str | None] = []
        self.violations: list[Violation] = []
        self.reported: set = set()
        self.cannot_tell: dict[tuple[str, str], list] = {}
        self.events = 0

    def _code(self, rid: str, tenant: str | None) -> int:
        c = self.codes.get(rid)
        if c is None:
            c = self.codes[rid] = len(self.names)
            self.names.append(rid)
            self.tenants.append(tenant)
        elif tenant is not None and self.tenants[c] is None:
            self.tenants[c] = tenant
        return c

    # ---- feeding ---------------------------------------------------------------------------------

    def feed(self, table: pa.Table, order: list[int] | None = None) -> None:
        """Judge one table of events, in ``order`` (row numbers; default: as they come)."""
        cols = {c: table.column(c).to_pylist() for c in _COLUMNS if c not in _LISTS}
        lists = {c: _flat(table.column(c)) for c in _LISTS}
        kinds = cols["kind"]
        names = [c for c in _COLUMNS if c not in _LISTS]
        for n in range(table.num_rows) if order is None else order:
            handler = getattr(self, "on_" + kinds[n], None)
            self.events += 1
            if handler is not None:
                e = {c: cols[c][n] for c in names}
                for c, (values, offsets, valid) in lists.items():
                    e[c] = values[offsets[n] : offsets[n + 1]] if valid[n] else None
                handler(e)

    def _pool(self, e: dict) -> _Pool | None:
        pool = self.pools.get((e["cluster"], e["node"]))
        if pool is not None and e.get("pages") is not None:
            pool.fit(e["pages"])
        return pool

    def _report(self, prop: str, e: dict, detail: str, key=None) -> None:
        if self.from_ns is not None and e["wall_ns"] < self.from_ns:
            return
        key = (prop, key if key is not None else (e["request_id"], e["node"]))
        if key in self.reported:
            return
        self.reported.add(key)
        producer = f"{e['cluster']}/{e['node']}/{e['instance']}"
        self.violations.append(Violation(prop, producer, e["seq"], e["node"], e["request_id"], detail, e["wall_ns"]))

    def _unknown(self, prop: str, why: str, e: dict) -> None:
        self.cannot_tell.setdefault((prop, why), []).append(e)

    # ---- handlers --------------------------------------------------------------------------------

    def on_node_config(self, e: dict) -> None:
        key = (e["cluster"], e["node"])
        if self.instance_of.get(key) != e["instance"]:
            self.instance_of[key] = e["instance"]
            self.pools[key] = _Pool()  # a new producer instance: a fresh pool

    def on_request_received(self, e: dict) -> None:
        self._code(e["request_id"], e["tenant_id"])

    def on_request_aborted(self, e: dict) -> None:
        self.stopped.setdefault((e["cluster"], e["node"], e["request_id"]), e)

    def on_pages_allocated(self, e: dict) -> None:
        pool = self._pool(e)
        if pool is None:
            return
        rid, pages = e["request_id"], e["pages"]
        code = self._code(rid, e["tenant_id"])
        if e["purpose"] == "prefix_hit":
            hashes = e["block_hashes"]
            for k, p in enumerate(pages.tolist()):
                pool.hits.setdefault(p, {})[code] = None if hashes is None else int(hashes[k])
            return
        if len(set(pages.tolist())) != len(pages):
            self._report("pages_conserved", e, f"one allocation lists a page twice: {pages.tolist()}")
        cur = pool.owner[pages]
        clash = (cur != FREE) & (cur != code)
        if clash.any():
            for k in np.flatnonzero(clash).tolist():
                p, other = int(pages[k]), int(cur[k])
                self._report("pages_conserved", e, f"page {p} allocated to {rid} while {self.names[other]} holds it")
                pool.extra.setdefault(p, []).append(other)
        pool.owner[pages] = code
        if e["purpose"] == "decode_growth":
            pool.writer[pages] = code  # the step that reads it fills it
            pool.whash[pages] = NO_HASH

    def on_pages_freed(self, e: dict) -> None:
        pool = self._pool(e)
        if pool is None:
            return
        rid, pages = e["request_id"], e["pages"]
        if rid is None:  # a radix eviction releases every holder
            pool.owner[pages] = FREE
            if pool.hits or pool.extra:
                for p in pages.tolist():
                    pool.hits.pop(p, None)
                    pool.extra.pop(p, None)  # every holder released
            return
        code = self._code(rid, e["tenant_id"])
        mine = pool.owner[pages] == code
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
        pool.owner[pages[mine]] = FREE
        if pool.extra:  # a second owner still holds the page: it becomes the owner
            for p in set(pool.extra).intersection(pages[mine].tolist()):
                pool.owner[p] = pool.extra[p].pop()
                if not pool.extra[p]:
                    del pool.extra[p]
        pool.freer[freed] = code
        for p in freed.tolist():
            pool.freed_ev[p] = e

    def on_kv_written(self, e: dict) -> None:
        pool = self._pool(e)
        if pool is None:
            return
        rid, pages = e["request_id"], e["pages"]
        code = self._code(rid, e["tenant_id"])
        if e["source"] == "transfer_in":
            late = ~pool.held_mask(pages, code) & (pool.freer[pages] == code)
            if late.any():
                p = int(pages[np.flatnonzero(late)[0]])
                self._report(
                    "no_free_before_drain",
                    pool.freed_ev[p],
                    f"{rid}'s write landed on page {p} after {rid} freed it (seq {e['seq']} of {e['node']})",
                )
        pool.writer[pages] = code
        hashes = e["block_hashes"]
        pool.whash[pages] = NO_HASH if hashes is None else hashes

    def on_transfer_received(self, e: dict) -> None:
        key = (e["cluster"], e["node"], e["request_id"])
        if e["status"] == "unverified":
            pool = self._pool(e)
            if pool is not None:
                pool.writer[e["pages"]] = UNKNOWN  # writer unknown from now on
            return
        if e["status"] in ("ok", "mismatch"):
            self.received[key] = (e["num_tokens"], e)

    def on_transfer_reserved(self, e: dict) -> None:
        self.reserved[(e["cluster"], e["node"], e["request_id"])] = e["num_tokens"]

    def on_transfer_sent(self, e: dict) -> None:
        rid = e["request_id"]
        self.sent[rid] = self.sent.get(rid, 0) + (e["num_tokens"] or 0)
        stop = self.stopped.get((e["cluster"], e["node"], rid))
        if stop is not None:
            self._report(
                "aborted_never_sent",
                e,
                f"{e['node']} sends {rid}'s KV after recording it aborted at {stop['node']}:{stop['seq']}",
            )

    def on_kv_read(self, e: dict) -> None:
        pool = self._pool(e)
        if pool is None:
            return
        rid, pages = e["request_id"], e["pages"]
        code = self._code(rid, e["tenant_id"])
        held = pool.held_mask(pages, code)
        writers = pool.writer[pages]
        bad = np.flatnonzero(~held | (writers != code))
        tenant = self.tenants[code]
        for k in bad.tolist():
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
            whash = int(pool.whash[p])
            wtenant = self.tenants[w]
            if hit is not None and hit == whash and wtenant == tenant:
                continue  # a sealed prefix of its own namespace
            why = "a prefix of another namespace" if hit is not None and hit == whash else "last written"
            self._report("no_foreign_read", e, f"{rid} ({tenant}) reads page {p}: {why} by {self.names[w]} ({wtenant})")
            break
        key = (e["cluster"], e["node"], rid)
        if key in self.reserved:
            want = self.reserved[key]
            got = self.received.get(key)
            if got is None:
                self._unknown("transferred_equals_reserved", "decode read with no receipt of the transfer", e)
            elif got[0] != want or self.sent.get(rid, want) != want:
                sent = self.sent.get(rid)
                self._report(
                    "transferred_equals_reserved",
                    got[1],
                    f"decode committed {rid}: {want} tokens reserved, {sent} sent, {got[0]} landed",
                )

    # ---- result ----------------------------------------------------------------------------------

    def coverage(self) -> list[dict]:
        out = []
        for (prop, why), evs in sorted(self.cannot_tell.items()):
            e = evs[0]
            out.append(
                {
                    "property": prop,
                    "cannot_tell": why,
                    "events": len(evs),
                    "first_event": {
                        "producer": f"{e['cluster']}/{e['node']}/{e['instance']}",
                        "seq": e["seq"],
                        "node": e["node"],
                        "request_id": e["request_id"],
                    },
                }
            )
        return out


def judge_order(table: pa.Table) -> list[int]:
    """Row numbers in the judge's order: wall time, then cluster, node, instance, seq."""
    keys = [(c, "ascending") for c in ("wall_ns", "cluster", "node", "instance", "seq")]
    return pc.sort_indices(table.select([k for k, _ in keys]), sort_keys=keys).to_pylist()


assert set(PROPERTIES) >= {"no_foreign_read", "aborted_never_sent", "no_free_before_drain"}
