"""Streaming replay of page ownership: audit events in, F1-F10 findings out.

:class:`ReplayEngine` walks events in time order and keeps, per node pool, a
:class:`~kvtrail.forensics.replay.pagestate.PageState`: numpy arrays indexed by page id (the exclusive holder,
who last wrote the page - request, time, digest, block hash, event -, a generation counter bumped on
every allocation).

Page findings (F1, F5, F6, F7, F10) and F8 are derived as events arrive; F2, F3, F4 and F9 join events
across nodes (:mod:`kvtrail.forensics.replay.joins`) and are derived when :meth:`ReplayEngine.findings` is
called, so the order in which different nodes' events arrive does not matter.

Rules beyond the mission's definitions: a prefix-cache read is legitimate (not F1) only when the page's
last writer recorded a block hash equal to the hit's; a ``decode_growth`` page read before anyone wrote
it since its allocation is filled by the very step that reads it (not F1).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.events import PRODUCER_FIELDS
from kvtrail.audit.store import read_events
from kvtrail.forensics.findings import Finding, make_finding
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.batch import (
    JOIN_CODES,
    JOIN_KINDS,
    PAGE_KINDS,
    SCALARS,
    ReplayBatch,
    codes_of,
    from_table,
    in_engine_order,
    register_requests,
    request_codes,
)
from kvtrail.forensics.replay.joins import CrossNodeJoins
from kvtrail.forensics.replay.pagestate import PageState
from kvtrail.forensics.window import window_filter

_PRODUCER_NAMES = tuple(f.name for f in PRODUCER_FIELDS)
_SCALARS = SCALARS  # the fields the handlers read, one list for both paths
class ReplayEngine:
    """Replays audit events (wire-shaped Arrow batches, in time order) and collects findings.

    ``producer_ids`` maps a producer identity tuple (cluster, node, role, engine, engine_version,
    instance) to its store id, so evidence names stored events; unknown producers get fresh ids.
    ``policy`` decides F9's thresholds and whether cross-tenant prefix sharing is a finding (F10).
    ``codes``: the findings wanted (default all); without F2/F3/F4/F9 the cross-node joins are skipped.
    ``fast``: replay finding-free page events in compiled runs (:mod:`kvtrail.forensics.replay.fast`,
    needs numba); None uses it when numba is installed; False replays every event in Python (the
    reference the fast path is tested against).
    """

    def __init__(self, producer_ids: dict[tuple, int] | None = None, policy: ForensicsPolicy = ForensicsPolicy(),
                 *, codes=None, fast: bool | None = None):
        self.producer_ids = dict(producer_ids or {})
        self.policy = policy
        self.codes = None if codes is None else frozenset(codes)
        self._need_joins = self.codes is None or bool(self.codes & JOIN_CODES)
        self._next_pid = max(self.producer_ids.values(), default=-1) + 1
        self._pools: dict[tuple[str, str], PageState] = {}
        self._pool_instance: dict[tuple[str, str], str] = {}
        self._requests: list[str] = []
        self._request_index: dict[str, int] = {}
        self._tenant: dict[str, str] = {}
        self._found: list[Finding] = []
        self._joins = CrossNodeJoins(policy)
        self._ord = 0
        self._fast = None
        if fast or (fast is None and importlib.util.find_spec("numba") is not None):
            from kvtrail.forensics.replay.fast import FastReplay

            self._fast = FastReplay(self, self._need_joins)

    # ---- input -------------------------------------------------------------------------------------

    def feed(self, table: pa.Table) -> None:
        """Replay one batch; rows are taken in (wall_ns, cluster, node, instance, seq) order."""
        if table.num_rows == 0:
            return
        table = in_engine_order(table)
        if self._fast is not None:
            self._fast.feed(from_table(table, self._producer_id))
            return
        is_page_event = codes_of(table.column("kind"), PAGE_KINDS) >= 0
        register_requests(self, is_page_event, *request_codes(table.column("request_id")))
        cols = {name: table.column(name).to_pylist() for name in _SCALARS}
        ident = list(zip(*(table.column(n).to_pylist() for n in _PRODUCER_NAMES)))
        pids = table.column("producer_id").to_pylist() if "producer_id" in table.column_names else None
        pages, poff = _flat(table.column("pages"), np.int64)
        digests, doff = _flat(table.column("page_digests"), np.uint64)
        hashes, hoff = _flat(table.column("block_hashes"), np.int64)
        ndst = pc.fill_null(pc.list_value_length(table.column("dst_pages")), 0).to_pylist()
        roles = self._joins.role
        for i in range(table.num_rows):
            pid = pids[i] if pids is not None else self._producer_id(ident[i])
            ev = {name: cols[name][i] for name in _SCALARS}
            ev["node_key"] = (ident[i][0], ident[i][1])
            roles[ev["node_key"]] = ident[i][2]
            ev["instance"] = ident[i][5]
            ev["key"] = (pid, ev["seq"])
            ev["ord"] = self._ord
            self._ord += 1
            ev["pages"] = pages[poff[i]:poff[i + 1]]
            ev["digests"] = digests[doff[i]:doff[i + 1]] if doff[i + 1] > doff[i] else None
            ev["hashes"] = hashes[hoff[i]:hoff[i + 1]] if hoff[i + 1] > hoff[i] else None
            ev["num_dst_pages"] = ndst[i]
            if ev["request_id"] is not None and ev["tenant_id"] is not None:
                self._tenant.setdefault(ev["request_id"], ev["tenant_id"])
            if not self._need_joins and ev["kind"] in JOIN_KINDS:
                continue
            handler = getattr(self, "_on_" + ev["kind"], None)
            if handler is not None:
                handler(ev)

    def feed_batch(self, batch: ReplayBatch) -> None:
        """Replay a batch already in engine order (the fast path's input, e.g. read straight from a store)."""
        if self._fast is None:
            raise ValueError("feed_batch: needs the fast path (ReplayEngine(fast=True), numba installed)")
        self._fast.feed(batch)

    def _producer_id(self, ident: tuple) -> int:
        if ident not in self.producer_ids:
            self.producer_ids[ident] = self._next_pid
            self._next_pid += 1
        return self.producer_ids[ident]

    def _req(self, request_id: str) -> int:
        r = self._request_index.get(request_id)
        if r is None:
            r = self._request_index[request_id] = len(self._requests)
            self._requests.append(request_id)
        return r

    def _pool(self, ev) -> PageState | None:
        pool = self._pools.get(ev["node_key"])
        if pool is None or not len(ev["pages"]):
            return None
        pool.fit(ev["pages"])
        return pool

    def _emit(self, code, ev, *, node=None, request=None, victims=(), pages=(), first_ns=None, evidence=(),
              detail="", lineage=(0, 0)):
        vic = tuple(sorted({self._requests[v] if v >= 0 else None for v in victims}, key=lambda x: (x is None, x)))
        self._found.append(make_finding(
            code, node=ev["node_key"][1] if node is None else node, request_id=request,
            tenant_id=self._tenant.get(request), victim_request_ids=vic,
            victim_tenant_ids=tuple(self._tenant.get(v) for v in vic), pages=tuple(int(p) for p in pages),
            first_ns=ev["wall_ns"] if first_ns is None else int(first_ns), last_ns=ev["wall_ns"],
            evidence=_keys([ev["key"], *evidence]), detail=detail, lineage_checked=int(lineage[0]),
            lineage_matched=int(lineage[1])))

    # ---- per-node events -----------------------------------------------------------------------------

    def _on_node_config(self, ev) -> None:
        key, n = ev["node_key"], int(ev["pool_pages"])
        pool = self._pools.get(key)
        if pool is None or self._pool_instance.get(key) != ev["instance"]:
            self._pools[key] = PageState(n)  # a new producer instance starts with a new, unwritten pool
            self._pool_instance[key] = ev["instance"]
        elif len(pool.owner) < n + 1:
            pool.grow(n + 1)
        self._joins.page_size[key] = int(ev["page_size"])
        if ev["pool_tokens"] < ev["context_tokens"]:
            self._emit("F8", ev, detail=f"pool holds {ev['pool_tokens']} tokens, context is {ev['context_tokens']}")

    def _on_pages_allocated(self, ev) -> None:
        pool, pages = self._pool(ev), ev["pages"]
        if pool is None:
            return
        r = self._req(ev["request_id"])
        if ev["purpose"] == "prefix_hit":  # shared radix-cache pages: many readers by design
            for p, h in zip(pages.tolist(), ev["hashes"].tolist()):
                pool.share(p, r, h)
            self._joins.prefix_hit(ev, len(pages))
            return
        owner = pool.owner[pages]
        busy = ((owner >= 0) & (owner != r)) | (pool.nshared[pages] > 0)
        if busy.any():
            victims, evidence = set(), []
            for p in pages[busy].tolist():
                victims |= pool.holders(p) - {r}
                if pool.owner[p] >= 0:
                    evidence.append(tuple(pool.alloc_ev[p]))
            busy_pages = [p for p in pages[busy].tolist() if pool.holders(p) - {r}]
            if busy_pages:
                self._emit("F6", ev, request=ev["request_id"], victims=victims, pages=busy_pages,
                           evidence=evidence, detail=f"allocated ({ev['purpose']}) while still held")
        free = owner < 0
        pool.owner[pages[free]] = r
        for p in pages[~free & (owner != r)].tolist():
            pool.extra.setdefault(p, set()).add(r)
        pool.alloc_ev[pages[free | (owner == r)]] = ev["key"]
        pool.alloc_req[pages] = r
        pool.alloc_growth[pages] = ev["purpose"] == "decode_growth"
        pool.gen[pages] += 1

    def _on_pages_freed(self, ev) -> None:
        pool, pages = self._pool(ev), ev["pages"]
        if pool is None:
            return
        if ev["request_id"] is not None:
            holders = [self._req(ev["request_id"])]
        else:  # radix eviction: the page leaves every holder
            holders = {int(o) for o in pool.owner[pages] if o >= 0}
            for p in pages.tolist():
                holders |= pool.holders(p)
        for r in holders:
            for p in pages.tolist():
                pool.drop(p, r)
            pool.remember_release(r, pages)

    def _on_kv_written(self, ev) -> None:
        if ev["request_id"] is not None:
            self._joins.written(ev)
        pool, pages = self._pool(ev), ev["pages"]
        if pool is None:
            return
        r = self._req(ev["request_id"])
        outside = ~pool.held_by(pages, r)
        if outside.any():
            late = pages[outside]
            was_held = pool.released_by(r, late)
            victims = set()
            for p in late.tolist():
                victims |= pool.holders(p)
            why = "after the request released them" if was_held.all() else "on pages the request never held"
            self._emit("F7", ev, request=ev["request_id"], victims=victims, pages=late, detail=f"write {why}")
        pool.writer[pages] = r
        pool.write_ns[pages] = ev["wall_ns"]
        pool.write_gen[pages] = pool.gen[pages]
        pool.write_ev[pages] = ev["key"]
        pool.has_digest[pages] = ev["digests"] is not None
        if ev["digests"] is not None:
            pool.digest[pages] = ev["digests"]
        pool.has_bhash[pages] = ev["hashes"] is not None
        if ev["hashes"] is not None:
            pool.bhash[pages] = ev["hashes"]

    def _on_kv_read(self, ev) -> None:
        pool, pages = self._pool(ev), ev["pages"]
        if pool is None:
            return
        r = self._req(ev["request_id"])
        held = pool.held_by(pages, r)
        if not held.all():
            outside = pages[~held]
            victims = set()
            for p in outside.tolist():
                victims |= pool.holders(p)
            self._emit("F5", ev, request=ev["request_id"], victims=victims, pages=outside,
                       detail="read of pages the request does not hold")
        is_hit, hit_hash = pool.hit_hashes(pages, r)
        # A prefix-cache hit is the radix cache working when the page still holds what it was keyed by.
        cached = is_hit & pool.has_bhash[pages] & (pool.bhash[pages] == hit_hash)
        # A growth page it holds, not written since its allocation, is filled by the step that reads it.
        fresh = held & (pool.alloc_req[pages] == r) & pool.alloc_growth[pages] & (pool.write_gen[pages] < pool.gen[pages])
        writer = pool.writer[pages]
        foreign = (writer != r) & ~cached & ~fresh
        for w in np.unique(writer[foreign]).tolist():
            sel = foreign & (writer == w)
            if w < 0:
                self._emit("F1", ev, request=ev["request_id"], victims=[-1], pages=pages[sel],
                           detail="read of pages never written since the pool was created")
                continue
            self._emit("F1", ev, request=ev["request_id"], victims=[w], pages=pages[sel],
                       first_ns=pool.write_ns[pages[sel]].min(), evidence=_write_keys(pool, pages[sel]),
                       detail=f"read of pages last written by {self._requests[w]}",
                       lineage=_lineage(pool, pages, sel, ev["digests"]))
        cross = cached & (writer >= 0) & (writer != r)
        if cross.any() and not self.policy.allow_tenant_cache_sharing:
            mine = self._tenant.get(ev["request_id"])
            for w in np.unique(writer[cross]).tolist():
                theirs = self._tenant.get(self._requests[w])
                if mine is None or theirs is None or mine == theirs:
                    continue
                sel = pages[cross & (writer == w)]
                self._emit("F10", ev, request=ev["request_id"], victims=[w], pages=sel,
                           first_ns=pool.write_ns[sel].min(), evidence=_write_keys(pool, sel),
                           detail=f"prefix-cache pages written for tenant {theirs} served to tenant {mine}")

    # ---- cross-node events (joined when findings are asked for) ------------------------------------

    def _on_transfer_reserved(self, ev) -> None:
        self._joins.transfer(ev)["reserved"] = ev

    def _on_transfer_sent(self, ev) -> None:
        self._joins.transfer(ev)["sent"].append(ev)

    def _on_transfer_received(self, ev) -> None:
        self._joins.transfer(ev)["received"] = ev

    def _on_request_aborted(self, ev) -> None:
        self._joins.aborted(ev)

    def _on_request_received(self, ev) -> None:
        self._joins.received(ev)

    def _on_response_sent(self, ev) -> None:
        if 200 <= ev["http_status"] < 300:
            self._joins.responses.append(ev)

    # ---- output ------------------------------------------------------------------------------------

    def findings(self) -> list[Finding]:
        """All findings so far, ordered by (last_ns, first_ns, code, evidence)."""
        saved, self._found = self._found, []
        try:
            self._joins.evaluate(self._emit)
            out = [f for f in saved + self._found if self.codes is None or f.code in self.codes]
        finally:
            self._found = saved
        return sorted(out, key=lambda f: (f.last_ns, f.first_ns, int(f.code[1:]), f.evidence))


def _write_keys(pool: PageState, pages: np.ndarray) -> set[tuple[int, int]]:
    return {tuple(k) for k in pool.write_ev[pages].tolist()}


def _lineage(pool: PageState, pages: np.ndarray, sel: np.ndarray, read_digests) -> tuple[int, int]:
    """(pages checked, pages whose read digest equals what their last writer recorded)."""
    if read_digests is None:
        return 0, 0
    checked = sel & pool.has_digest[pages]
    return int(checked.sum()), int((checked & (pool.digest[pages] == read_digests)).sum())


def _keys(items) -> tuple[tuple[int, int], ...]:
    return tuple(sorted({(int(p), int(s)) for p, s in items if p >= 0}))


def _flat(col: pa.ChunkedArray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Flat values and offsets of a list column (null lists count as empty)."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = pc.list_flatten(col).to_numpy(zero_copy_only=False)
    return values.astype(dtype), offsets


def replay_store(con, from_ns: int | None = None, to_ns: int | None = None, policy: ForensicsPolicy = ForensicsPolicy(),
                 *, codes=None, fast: bool | None = None) -> list[Finding]:
    """Findings of the events in [from_ns, to_ns] of an audit store (a DuckDB connection).

    Each producer is replayed from its last ``node_config`` at or before ``from_ns`` so page state at
    the window's start is known; findings that end before ``from_ns`` are left out. ``codes`` and
    ``fast`` are :class:`ReplayEngine`'s.
    """
    where, params = window_filter(from_ns, to_ns)
    rows = con.execute(f"SELECT producer_id, {', '.join(_PRODUCER_NAMES)} FROM producers").fetchall()
    engine = ReplayEngine({tuple(r[1:]): r[0] for r in rows}, policy, codes=codes, fast=fast)
    if engine._fast is not None:  # read in engine order, in bounded slices, straight into the fast path
        from kvtrail.forensics.replay.kernels import warm_up
        from kvtrail.forensics.replay.source import store_batches

        for batch in store_batches(con, where, params, meanwhile=warm_up):
            engine.feed_batch(batch)
    else:
        engine.feed(read_events(con, where, params))
    found = engine.findings()
    return [f for f in found if from_ns is None or f.last_ns >= from_ns]
