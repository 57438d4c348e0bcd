"""Streaming replay of page ownership: audit events in, F1-F8 findings out.

:class:`ReplayEngine` walks events in time order and keeps, per node pool, numpy arrays indexed by
page id: the exclusive holder, who last wrote the page (request, time, digest, event), a generation
counter bumped on every allocation. The rare states (a page held twice, pages shared as prefix-cache
hits, pages a request already released) live in small dicts beside them, so the common case of an
event is a handful of vectorised array operations.

Page findings (F1, F5, F6, F7) and F8 are derived as events arrive; F2, F3 and F4 join events across
nodes (by ``transfer_id`` or ``request_id``) and are derived when :meth:`ReplayEngine.findings` is
called, so the order in which the two nodes' events arrive does not matter.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.events import PRODUCER_FIELDS
from kvtrail.audit.store import read_events
from kvtrail.forensics.findings import Finding, make_finding

_PRODUCER_NAMES = tuple(f.name for f in PRODUCER_FIELDS)
_SCALARS = ("kind", "seq", "wall_ns", "request_id", "transfer_id", "tenant_id", "purpose", "num_tokens",
            "digest", "digest_algo", "status", "http_status", "stage", "abort_reason", "pool_tokens",
            "pool_pages", "context_tokens")
_GROWTH = 1  # purpose code of decode_growth: a fresh page the request fills itself before reading it
_OK_RECEIVED = ("ok", "mismatch")  # decode took the KV as landed; failed/aborted transfers serve nothing


class _Pool:
    """The page state of one node's KV pool, arrays indexed by page id (0 is padding)."""

    def __init__(self, num_pages: int):
        n = num_pages + 1
        self.owner = np.full(n, -1, np.int32)      # exclusive holder (request index)
        self.purpose = np.zeros(n, np.int8)        # 1 when the owner got the page as decode_growth
        self.gen = np.zeros(n, np.int64)           # bumped on every exclusive allocation
        self.alloc_ev = np.full((n, 2), -1, np.int64)
        self.nshared = np.zeros(n, np.int32)       # prefix-cache holders
        self.writer = np.full(n, -1, np.int32)
        self.write_ns = np.zeros(n, np.int64)
        self.write_gen = np.full(n, -1, np.int64)
        self.write_ev = np.full((n, 2), -1, np.int64)
        self.digest = np.zeros(n, np.uint64)
        self.has_digest = np.zeros(n, bool)
        self.extra: dict[int, set[int]] = {}       # further exclusive holders: double ownership (F6)
        self.shared: dict[int, set[int]] = {}
        self.released: dict[int, list[np.ndarray]] = {}  # request -> page arrays it freed

    def holders(self, p: int) -> set[int]:
        out = set(self.extra.get(p, ())) | self.shared.get(p, set())
        if self.owner[p] >= 0:
            out.add(int(self.owner[p]))
        return out

    def held_by(self, pages: np.ndarray, r: int) -> np.ndarray:
        held = self.owner[pages] == r
        for i in np.flatnonzero(~held):
            p = int(pages[i])
            held[i] = r in self.extra.get(p, ()) or r in self.shared.get(p, ())
        return held

    def drop(self, p: int, r: int) -> None:
        """Remove request r from the holders of page p."""
        if r in self.shared.get(p, ()):
            self.shared[p].discard(r)
            self.nshared[p] -= 1
        if r in self.extra.get(p, ()):
            self.extra[p].discard(r)
        if self.owner[p] == r:
            more = self.extra.get(p)
            self.owner[p] = more.pop() if more else -1
            self.purpose[p] = 0  # a promoted holder did not get the page as a fresh growth page
        if not self.extra.get(p, True):
            del self.extra[p]


class ReplayEngine:
    """Replays audit events (wire-shaped Arrow batches, in time order) and collects findings.

    ``producer_ids`` maps a producer identity tuple (cluster, node, role, engine, engine_version,
    instance) to its store id, so evidence names stored events; unknown producers get fresh ids.
    """

    def __init__(self, producer_ids: dict[tuple, int] | None = None):
        self.producer_ids = dict(producer_ids or {})
        self._next_pid = max(self.producer_ids.values(), default=-1) + 1
        self._pools: dict[tuple[str, str], _Pool] = {}
        self._pool_instance: dict[tuple[str, str], str] = {}
        self._requests: list[str] = []
        self._request_index: dict[str, int] = {}
        self._tenant: dict[str, str] = {}
        self._found: list[Finding] = []
        self._transfers: dict[int, dict] = {}
        self._aborts: dict[tuple[str, object], list] = {}
        self._responses: list[tuple] = []

    # ---- input -------------------------------------------------------------------------------------

    def feed(self, table: pa.Table) -> None:
        """Replay one batch; rows are taken in (wall_ns, cluster, node, instance, seq) order."""
        if table.num_rows == 0:
            return
        table = table.sort_by([("wall_ns", "ascending"), ("cluster", "ascending"), ("node", "ascending"),
                               ("instance", "ascending"), ("seq", "ascending")]).combine_chunks()
        cols = {name: table.column(name).to_pylist() for name in _SCALARS}
        ident = list(zip(*(table.column(n).to_pylist() for n in _PRODUCER_NAMES)))
        pids = table.column("producer_id").to_pylist() if "producer_id" in table.column_names else None
        pages, poff = _flat(table.column("pages"), np.int64)
        digests, doff = _flat(table.column("page_digests"), np.uint64)
        ndst = pc.fill_null(pc.list_value_length(table.column("dst_pages")), 0).to_pylist()
        for i in range(table.num_rows):
            pid = pids[i] if pids is not None else self._producer_id(ident[i])
            ev = {name: cols[name][i] for name in _SCALARS}
            ev["node_key"] = (ident[i][0], ident[i][1])
            ev["instance"] = ident[i][5]
            ev["key"] = (pid, ev["seq"])
            ev["pages"] = pages[poff[i]:poff[i + 1]]
            ev["digests"] = digests[doff[i]:doff[i + 1]] if doff[i + 1] > doff[i] else None
            ev["num_dst_pages"] = ndst[i]
            if ev["request_id"] is not None and ev["tenant_id"] is not None:
                self._tenant.setdefault(ev["request_id"], ev["tenant_id"])
            handler = getattr(self, "_on_" + ev["kind"], None)
            if handler is not None:
                handler(ev)

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

    def _pool(self, ev) -> _Pool | None:
        return self._pools.get(ev["node_key"])

    def _emit(self, code, ev, *, request=None, victims=(), pages=(), first_ns=None, evidence=(), detail=""):
        vic = tuple(sorted({self._requests[v] if v >= 0 else None for v in victims}, key=lambda x: (x is None, x)))
        self._found.append(make_finding(
            code, node=ev["node_key"][1], request_id=request, tenant_id=self._tenant.get(request),
            victim_request_ids=vic, victim_tenant_ids=tuple(self._tenant.get(v) for v in vic),
            pages=tuple(int(p) for p in pages), first_ns=ev["wall_ns"] if first_ns is None else int(first_ns),
            last_ns=ev["wall_ns"], evidence=_keys([ev["key"], *evidence]), detail=detail))

    # ---- per-node events -----------------------------------------------------------------------------

    def _on_node_config(self, ev) -> None:
        key, n = ev["node_key"], int(ev["pool_pages"])
        pool = self._pools.get(key)
        if pool is None or self._pool_instance.get(key) != ev["instance"]:
            self._pools[key] = _Pool(n)  # a new producer instance starts with a new, unwritten pool
            self._pool_instance[key] = ev["instance"]
        elif len(pool.owner) < n + 1:
            _grow(pool, n + 1)
        if ev["pool_tokens"] < ev["context_tokens"]:
            self._emit("F8", ev, detail=f"pool holds {ev['pool_tokens']} tokens, context is {ev['context_tokens']}")

    def _on_pages_allocated(self, ev) -> None:
        pool, pages = self._pool(ev), ev["pages"]
        if pool is None or not len(pages):
            return
        _fit(pool, pages)
        r = self._req(ev["request_id"])
        if ev["purpose"] == "prefix_hit":  # shared radix-cache pages: many readers by design
            for p in pages.tolist():
                s = pool.shared.setdefault(p, set())
                if r not in s:
                    s.add(r)
                    pool.nshared[p] += 1
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
        mine = pages[free | (owner == r)]
        pool.purpose[mine] = _GROWTH if ev["purpose"] == "decode_growth" else 0
        pool.alloc_ev[mine] = ev["key"]
        pool.gen[pages] += 1

    def _on_pages_freed(self, ev) -> None:
        pool, pages = self._pool(ev), ev["pages"]
        if pool is None or not len(pages):
            return
        _fit(pool, pages)
        if ev["request_id"] is not None:
            holders = [self._req(ev["request_id"])]
        else:  # radix eviction: the page leaves every holder
            holders = {int(o) for o in pool.owner[pages] if o >= 0}
            for p in pages.tolist():
                holders |= pool.holders(p)
        for r in holders:
            for p in pages.tolist():
                pool.drop(p, r)
            pool.released.setdefault(r, []).append(pages)

    def _on_kv_written(self, ev) -> None:
        pool, pages = self._pool(ev), ev["pages"]
        if pool is None or not len(pages):
            return
        _fit(pool, pages)
        r = self._req(ev["request_id"])
        outside = ~pool.held_by(pages, r)
        if outside.any():
            late = pages[outside]
            released = pool.released.get(r)
            was_held = np.isin(late, np.concatenate(released)) if released else np.zeros(len(late), bool)
            victims = set()
            for p in late.tolist():
                victims |= pool.holders(p)
            why = "after the request released them" if was_held.all() else "on pages the request never held"
            self._emit("F7", ev, request=ev["request_id"], victims=victims, pages=late, detail=f"write {why}")
        pool.writer[pages] = r
        pool.write_ns[pages] = ev["wall_ns"]
        pool.write_gen[pages] = pool.gen[pages]
        pool.write_ev[pages] = ev["key"]
        if ev["digests"] is not None:
            pool.digest[pages] = ev["digests"]
        pool.has_digest[pages] = ev["digests"] is not None

    def _on_kv_read(self, ev) -> None:
        pool, pages = self._pool(ev), ev["pages"]
        if pool is None or not len(pages):
            return
        _fit(pool, pages)
        r = self._req(ev["request_id"])
        held = pool.held_by(pages, r)
        if not held.all():
            outside = pages[~held]
            victims = set()
            for p in outside.tolist():
                victims |= pool.holders(p)
            self._emit("F5", ev, request=ev["request_id"], victims=victims, pages=outside,
                       detail="read of pages the request does not hold")
        shared = np.array([r in pool.shared.get(p, ()) for p in pages.tolist()], bool) \
            if pool.nshared[pages].any() else np.zeros(len(pages), bool)
        # A growth page not written since its allocation is filled by the very step that reads it.
        fresh = (pool.owner[pages] == r) & (pool.purpose[pages] == _GROWTH) & (pool.write_gen[pages] < pool.gen[pages])
        writer = pool.writer[pages]
        foreign = (writer != r) & ~shared & ~fresh
        for w in np.unique(writer[foreign]).tolist():
            sel = pages[foreign & (writer == w)]
            if w < 0:
                self._emit("F1", ev, request=ev["request_id"], victims=[-1], pages=sel,
                           detail="read of pages never written since the pool was created")
                continue
            evidence = {tuple(k) for k in pool.write_ev[sel].tolist()}
            self._emit("F1", ev, request=ev["request_id"], victims=[w], pages=sel,
                       first_ns=pool.write_ns[sel].min(), evidence=evidence,
                       detail=f"read of pages last written by {self._requests[w]}")

    # ---- cross-node events (joined when findings are asked for) ------------------------------------

    def _transfer(self, ev) -> dict:
        return self._transfers.setdefault(ev["transfer_id"], {"rid": ev["request_id"], "sent": []})

    def _on_transfer_reserved(self, ev) -> None:
        self._transfer(ev)["reserved"] = ev

    def _on_transfer_sent(self, ev) -> None:
        self._transfer(ev)["sent"].append(ev)

    def _on_transfer_received(self, ev) -> None:
        self._transfer(ev)["received"] = ev

    def _on_request_aborted(self, ev) -> None:
        self._aborts.setdefault(("rid", ev["request_id"]), []).append(ev)
        if ev["transfer_id"] is not None:
            self._aborts.setdefault(("tid", ev["transfer_id"]), []).append(ev)

    def _on_response_sent(self, ev) -> None:
        if 200 <= ev["http_status"] < 300:
            self._responses.append(ev)

    def _joined(self) -> list[Finding]:
        saved, self._found = self._found, []
        try:
            for t in self._transfers.values():
                self._check_transfer(t)
            for resp in self._responses:
                aborts = {a["key"]: a for k in (("rid", resp["request_id"]), ("tid", resp["transfer_id"]))
                          for a in self._aborts.get(k, ()) if k[1] is not None}
                if aborts:
                    first = min(a["wall_ns"] for a in aborts.values())
                    what = "; ".join(sorted({f"{a['stage']}: {a['abort_reason']} ({a['http_status']})"
                                             for a in aborts.values()}))
                    self._emit("F4", resp, request=resp["request_id"], first_ns=first, evidence=aborts,
                               detail=f"HTTP {resp['http_status']} after abort: {what}")
            return self._found
        finally:
            self._found = saved

    def _check_transfer(self, t: dict) -> None:
        res, rec, sent = t.get("reserved"), t.get("received"), t["sent"]
        if rec is None or rec["status"] not in _OK_RECEIVED:
            return
        evidence = [e["key"] for e in (res, *sent) if e is not None]
        first = min(e["wall_ns"] for e in (res, rec, *sent) if e is not None)
        if res is not None:
            problems = []
            if sent:
                sent_tokens = sum(e["num_tokens"] for e in sent)
                sent_pages = sum(e["num_dst_pages"] for e in sent)
                if sent_tokens != res["num_tokens"] or sent_pages != len(res["pages"]):
                    problems.append(f"sent {sent_tokens} tokens/{sent_pages} pages")
            if rec["num_tokens"] != res["num_tokens"]:
                problems.append(f"received {rec['num_tokens']} tokens")
            if problems:
                self._emit("F2", rec, request=rec["request_id"], pages=res["pages"], first_ns=first,
                           evidence=evidence, detail=f"reserved {res['num_tokens']} tokens/{len(res['pages'])} "
                                                     f"pages; " + ", ".join(problems))
        with_digest = [e for e in sent if e["digest"] is not None]
        src = with_digest[-1] if with_digest else None
        comparable = src is not None and rec["digest"] is not None and src["digest_algo"] == rec["digest_algo"]
        if (comparable and src["digest"] != rec["digest"]) or (not comparable and rec["status"] == "mismatch"):
            detail = (f"prefill digest {src['digest']:#x} != decode digest {rec['digest']:#x} ({rec['digest_algo']})"
                      if comparable else "decode reported a digest mismatch")
            self._emit("F3", rec, request=rec["request_id"], pages=rec["pages"], first_ns=first,
                       evidence=evidence, detail=detail)

    # ---- output ------------------------------------------------------------------------------------

    def findings(self) -> list[Finding]:
        """All findings so far, ordered by (last_ns, code)."""
        out = self._found + self._joined()
        return sorted(out, key=lambda f: (f.last_ns, f.first_ns, int(f.code[1:]), f.evidence))


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


def _fit(pool: _Pool, pages: np.ndarray) -> None:
    need = int(pages.max()) + 1
    if need > len(pool.owner):
        _grow(pool, need)


def _grow(pool: _Pool, n: int) -> None:
    """Extend every page array to n entries with the values of an unused page."""
    fresh = _Pool(n - 1)
    for name, arr in vars(pool).items():
        if isinstance(arr, np.ndarray):
            new = getattr(fresh, name)
            new[: len(arr)] = arr
            setattr(pool, name, new)


def window_filter(from_ns: int | None, to_ns: int | None) -> tuple[str, list]:
    """SQL filter on ``events_v`` for a window: each producer from its last node_config at or before
    ``from_ns`` (so page state at the window's start is known), up to ``to_ns``."""
    where, params = ["TRUE"], []
    if from_ns is not None:
        where.append("wall_ns >= coalesce((SELECT max(c.wall_ns) FROM events c WHERE c.kind = 'node_config' "
                     "AND c.producer_id = events_v.producer_id AND c.wall_ns <= ?), ?)")
        params += [from_ns, from_ns]
    if to_ns is not None:
        where.append("wall_ns <= ?")
        params.append(to_ns)
    return " AND ".join(where), params


def replay_store(con, from_ns: int | None = None, to_ns: int | None = None) -> list[Finding]:
    """Findings of the events in [from_ns, to_ns] of an audit store (a DuckDB connection).

    Each producer is replayed from its last ``node_config`` at or before ``from_ns`` so page state at
    the window's start is known; findings that end before ``from_ns`` are left out.
    """
    where, params = window_filter(from_ns, to_ns)
    rows = con.execute(f"SELECT producer_id, {', '.join(_PRODUCER_NAMES)} FROM producers").fetchall()
    engine = ReplayEngine({tuple(r[1:]): r[0] for r in rows})
    engine.feed(read_events(con, where, params))
    found = engine.findings()
    return [f for f in found if from_ns is None or f.last_ns >= from_ns]
