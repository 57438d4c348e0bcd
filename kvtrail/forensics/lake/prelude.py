"""A checkpoint as events: the prelude the SQL engine reads before a partition's own events.

The SQL engine (:mod:`kvtrail.forensics.sql`) has no state to restore: it judges a page from the
allocations, releases and writes before each access. A partition task therefore puts, before the
hour's events, a few synthetic events per page that leave exactly the checkpoint's pool behind, in
an order that keeps what the engine compares:

- the pages each request released (the bounded release history: F5/F7's "after the request released
  them"): a shared hold and its release;
- the page's last write (its real writer, time, digests and block hashes) before or after the page's
  last exclusive allocation as its generation says (a fresh growth page, F1's own-KV corruption), the
  writer holding the page at that moment unless it was a late write, in which case the write it
  overwrote comes before it; a page an unverified transfer landed on (writer unknown) gets that receipt
  instead, at the same place;
- the owner's allocation, further exclusive holders, the last exclusive allocation (its purpose: a
  growth page or not), the prefix-cache holders with their block hashes, and last the release of
  every synthetic holder the checkpoint no longer names.

Synthetic events belong to one synthetic producer of the node (with the checkpoint's instance, so the
pool's epoch continues into the hour), carry ``pre``, their place in that order, and stand for the real
events the checkpoint keeps (``keys``: last writes, owners' allocations), which replace them in a
finding's evidence. Shared holds carry :data:`~kvtrail.forensics.sql.engine.HOLD_PURPOSE`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from kvtrail.forensics.findings import UNVERIFIED
from kvtrail.forensics.replay.pagestate import PageState
from kvtrail.forensics.sql.engine import HOLD_PURPOSE

Key = tuple[int, int]


@dataclass
class Prelude:
    """Synthetic rows for ``events`` (plus ``pre``), ``page_runs`` and ``producers``, and the real event
    each synthetic one stands for (synthetic seq -> key, absent: none)."""

    producer_id: int
    rows: list[dict] = field(default_factory=list)
    runs: list[tuple[int, int, int, int]] = field(default_factory=list)  # seq, pos, page_start, num_pages
    keys: dict[int, Key] = field(default_factory=dict)

    def add(
        self,
        kind: str,
        rid: str | None,
        tenant: str | None,
        pages: np.ndarray,
        wall_ns: int,
        *,
        purpose: str | None = None,
        hashes: np.ndarray | None = None,
        digests: np.ndarray | None = None,
        real: Key | None = None,
        status: str | None = None,
    ) -> None:
        seq = len(self.rows)
        self.rows.append(
            {
                "producer_id": self.producer_id,
                "seq": seq,
                "pre": seq,
                "wall_ns": int(wall_ns),
                "kind": kind,
                "request_id": rid,
                "tenant_id": tenant,
                "purpose": purpose,
                "status": status,
                "num_pages": len(pages),
                "num_dst_pages": 0,
                "block_hashes": None if hashes is None else hashes.tolist(),
                "page_digests": None if digests is None else digests.tolist(),
            }
        )
        if self.rows[-1]["num_pages"] == 0:
            return
        breaks = np.flatnonzero(np.diff(pages) != 1) + 1
        starts = np.concatenate([[0], breaks])
        ends = np.concatenate([breaks, [len(pages)]])
        self.runs.extend((seq, int(s), int(pages[s]), int(e - s)) for s, e in zip(starts, ends))
        if real is not None and real[0] >= 0:
            self.keys[seq] = real

    def tables(self, events_schema: pa.Schema, runs_schema: pa.Schema) -> tuple[pa.Table, pa.Table]:
        cols = {}
        for f in events_schema:
            cols[f.name] = pa.array([r.get(f.name) for r in self.rows], f.type)
        events = pa.table(cols, schema=events_schema)
        arr = np.array(self.runs, np.int64).reshape(-1, 4)
        runs = pa.table(
            {
                "producer_id": pa.array(np.full(len(arr), self.producer_id), pa.int64()),
                "batch_no": pa.array(np.zeros(len(arr), np.int64)),
                "seq": pa.array(arr[:, 0], pa.uint64()),
                "list": pa.array(np.zeros(len(arr), np.int8)),
                "pos": pa.array(arr[:, 1], pa.int32()),
                "page_start": pa.array(arr[:, 2], pa.int32()),
                "num_pages": pa.array(arr[:, 3], pa.int32()),
            }
        )
        return events, runs.cast(runs_schema)


def _groups(pages: np.ndarray, *cols: np.ndarray):
    """Split ``pages`` by equal values of ``cols`` (per page): (values, pages) per group, the groups in
    ascending order of their values, each group's pages in their order in ``pages``."""
    if not len(pages):
        return
    keys = [np.asarray(c, np.int64) for c in cols]
    # np.lexsort's last key sorts first; the position breaks ties, so each group keeps the pages' order
    order = np.lexsort([np.arange(len(pages))] + keys[::-1])
    by = [k[order] for k in keys]
    starts = np.zeros(len(order), bool)
    starts[0] = True
    for k in by:
        starts[1:] |= k[1:] != k[:-1]
    first = np.flatnonzero(starts)
    bounds = np.append(first[1:], len(order)).tolist()
    for start, end in zip(first.tolist(), bounds):
        yield tuple(int(k[start]) for k in by), pages[order[start:end]]


class _Builder:
    """Walks one pool's state in the prelude's order (see the module doc)."""

    def __init__(self, pool: PageState, requests: list, tenants: list, out: Prelude, prelude_ns: int):
        self.pool, self.requests, self.tenants, self.out, self.ns = pool, requests, tenants, out, prelude_ns
        self.shared = pool.shared()

    def rid(self, r: int) -> str | None:
        return self.requests[r]

    def tenant(self, r: int) -> str | None:
        """The tenant request ``r`` is keyed by (its events name it, so the engine keys them alike)."""
        return self.tenants[r] if r >= 0 else None

    def holds(self, pages: np.ndarray, reqs: np.ndarray) -> np.ndarray:
        """Whether request reqs[i] holds pages[i] in the checkpoint (owner, further holder or hit)."""
        out = self.pool.owner[pages] == reqs
        rest = np.flatnonzero(~out & (reqs >= 0))
        if not len(rest):
            return out
        held = [(p, r) for p, rs in self.pool.extra.items() for r in rs]
        held += [(p, r) for p, hits in self.shared.items() for r in hits]
        if held:
            pairs = np.array(held, np.int64).reshape(-1, 2)
            # a (page, request) pair as one integer: page ids are 32-bit, request numbers in [0, 2**32)
            want = (pages[rest].astype(np.int64) << 32) | reqs[rest].astype(np.int64)
            out[rest] = np.isin(want, (pairs[:, 0] << 32) | pairs[:, 1])
        return out

    def emit(self, kind: str, pages: np.ndarray, reqs: np.ndarray, *, purpose=None, real=None, extra=()) -> None:
        """One synthetic event per request (and per real key / extra column value) over ``pages`` (page ids;
        ``reqs``, ``real`` and ``extra`` are arrays of the pool's entries)."""
        pages = np.sort(pages)
        at = self.pool.slots.many(pages)
        cols = [reqs[at]] + ([] if real is None else [real[at, 0], real[at, 1]]) + [c[at] for c in extra]
        for values, ps in _groups(pages, *cols):
            r = values[0]
            rid = self.rid(r) if r >= 0 else None
            if kind != "kv_written" and rid is None:
                continue  # a release without a request is a radix eviction (it would drop every holder)
            key = (values[1], values[2]) if real is not None else None
            p_purpose = purpose(values) if callable(purpose) else purpose
            self.out.add(kind, rid, self.tenant(r), ps, self.ns, purpose=p_purpose, real=key)

    def writes(self, pages: np.ndarray) -> None:
        """The last write of each page (its real event, time, digests and block hashes)."""
        pool, pages = self.pool, np.sort(pages)
        for values, ps in _groups(
            pages,
            pool.writer[pages],
            pool.write_ev[pages, 0],
            pool.write_ev[pages, 1],
            pool.has_bhash[pages],
            pool.has_digest[pages],
        ):
            r, k0, k1, has_bh, has_dg = values
            rid = self.rid(r)
            self.out.add(
                "kv_written",
                rid,
                self.tenant(r),
                ps,
                int(pool.write_ns[ps[0]]),
                hashes=pool.bhash[ps] if has_bh else None,
                digests=pool.digest[ps] if has_dg else None,
                real=(k0, k1),
            )

    def unverified(self, pages: np.ndarray) -> None:
        """Pages an unverified transfer landed on (writer unknown): that receipt, as the engine reads it."""
        pool, pages = self.pool, np.sort(pages)
        for (k0, k1), ps in _groups(pages, pool.write_ev[pages, 0], pool.write_ev[pages, 1]):
            self.out.add(
                "transfer_received", None, None, ps, int(pool.write_ns[ps[0]]), real=(k0, k1), status=UNVERIFIED
            )


def build_prelude(pool: PageState, requests: list, tenants: list, producer_id: int, prelude_ns: int) -> Prelude:
    """The synthetic events that leave ``pool`` behind (see the module doc)."""
    out = Prelude(producer_id)
    # the pool's configuration first: the engine ignores page events before a node's first node_config
    out.add("node_config", None, None, np.zeros(0, np.int64), prelude_ns)
    b = _Builder(pool, requests, tenants, out, prelude_ns)
    # Arrays over the pool's entries; idx is each entry's page id (its sparse pages after the dense part).
    n = pool.num_entries
    idx = pool.page_of_entries()
    slot = pool.slots.one
    owner, areq = pool.raw("owner").astype(np.int64), pool.raw("alloc_req").astype(np.int64)
    writer = pool.raw("writer").astype(np.int64)
    gen, wgen, write_ev = pool.raw("gen"), pool.raw("write_gen"), pool.raw("write_ev")
    # released history: a hold and its release, before anything else
    rel_pages, rel_reqs = [], []
    for r, lists in pool.released.items():
        ps = np.unique(np.concatenate(lists).astype(np.int64))
        rel_pages.append(ps)
        rel_reqs.append(np.full(len(ps), r, np.int64))
    if rel_pages:
        rp, rr = np.concatenate(rel_pages), np.concatenate(rel_reqs)
        for kind, purpose in (("pages_allocated", HOLD_PURPOSE), ("pages_freed", None)):
            for (r,), ps in _groups(np.arange(len(rp)), rr):
                pages = np.sort(rp[ps])
                rid = b.rid(r)
                if rid is None:
                    continue
                out.add(kind, rid, b.tenant(r), pages, prelude_ns, purpose=purpose)
    late_cur = np.zeros(n, bool)
    late_prev = np.full(n, -1, np.int64)
    late_gen = np.full(n, -1, np.int64)
    for p, (k, w, g) in pool.late.items():
        if k == (int(pool.write_ev[p, 0]), int(pool.write_ev[p, 1])):
            late_cur[slot(p)], late_prev[slot(p)], late_gen[slot(p)] = True, w, g
    written = writer >= 0
    early = written & (wgen < gen)  # written before the page's last exclusive allocation
    after = written & ~early
    unverified = (writer < 0) & (write_ev[:, 0] >= 0)  # landed by an unverified transfer: writer unknown
    in_extra = np.zeros(n, bool)
    for p, rs in pool.extra.items():
        in_extra[slot(p)] = int(writer[slot(p)]) in rs
    prev = late_cur & (late_prev >= 0)
    b.emit("kv_written", idx[prev & (late_gen < gen)], late_prev)
    b.emit("pages_allocated", idx[early & ~late_cur], writer, purpose=HOLD_PURPOSE)
    b.writes(idx[early])
    b.unverified(idx[unverified & (wgen < gen)])
    b.emit("pages_allocated", idx[(owner >= 0) & (owner != areq)], owner, real=pool.raw("alloc_ev"))
    extras = [(p, r) for p, rs in sorted(pool.extra.items()) for r in sorted(rs) if r != areq[slot(p)]]
    if extras:
        ep = np.array(extras, np.int64).reshape(-1, 2)
        for (r,), ps in _groups(np.arange(len(ep)), ep[:, 1]):
            pages = np.sort(ep[ps, 0])
            rid = b.rid(r)
            out.add("pages_allocated", rid, b.tenant(r), pages, prelude_ns)
    last = idx[areq >= 0]
    is_owner = (owner == areq).astype(np.int64)
    alloc_key = np.where(is_owner[:, None] == 1, pool.raw("alloc_ev"), -1)
    b.emit(
        "pages_allocated",
        last,
        areq,
        real=alloc_key,
        extra=(pool.alloc_growth.astype(np.int64),),
        purpose=lambda v: "decode_growth" if v[-1] else None,
    )
    b.emit("kv_written", idx[prev & (late_gen >= gen)], late_prev)
    hold_after = after & ~late_cur & (writer != areq) & (writer != owner) & ~in_extra
    b.emit("pages_allocated", idx[hold_after], writer, purpose=HOLD_PURPOSE)
    b.writes(idx[after])
    b.unverified(idx[unverified & (wgen >= gen)])
    for r, ps_hs in _hits_by_request(b.shared).items():
        rid = b.rid(r)
        ps = np.array([p for p, _ in ps_hs], np.int64)
        out.add(
            "pages_allocated",
            rid,
            b.tenant(r),
            ps,
            prelude_ns,
            purpose="prefix_hit",
            hashes=np.array([h for _, h in ps_hs], np.int64),
        )
    # last: release every synthetic holder the checkpoint no longer names
    cand_p = np.concatenate([idx[areq >= 0], idx[(early & ~late_cur) | hold_after]])
    cand_r = np.concatenate([areq[areq >= 0], writer[(early & ~late_cur) | hold_after]])
    gone = ~b.holds(cand_p, cand_r)
    pairs = np.unique(np.stack([cand_r[gone], cand_p[gone]], axis=1), axis=0)
    for (r,), ps in _groups(np.arange(len(pairs)), pairs[:, 0]):
        rid = b.rid(r)
        if rid is not None:
            out.add("pages_freed", rid, b.tenant(r), np.sort(pairs[ps, 1]), prelude_ns)
    return out


def _hits_by_request(shared: dict[int, dict[int, int]]) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list[tuple[int, int]]] = {}
    for p, hits in shared.items():
        for r, h in hits.items():
            out.setdefault(r, []).append((p, h))
    return out
