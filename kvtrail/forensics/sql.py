"""A second, independent findings engine: DuckDB SQL over the audit store (F2, F4, F5, F6, F7, F8).

Where :mod:`kvtrail.forensics.replay` walks events one by one, this module asks the store directly.
Page questions are range joins over ``page_runs``: runs are joined by node, pool epoch and
overlapping page ranges (``a.page_start <= b.page_end AND b.page_start <= a.page_end``) and only the
overlap of two runs is expanded to single pages, so the store's pages are never exploded wholesale.

Model (the replay engine's rules, restated over the record):

* Events are ordered by ``(wall_ns, cluster, node, instance, seq)`` (``ord``). A node's pool is
  identified by ``(cluster, node, epoch)``; a ``node_config`` from a new producer instance starts a
  new epoch (a fresh pool). Page events before a node's first ``node_config`` are ignored.
* Request R holds page p at ``ord`` t when, of R's allocations and releases of p before t (a release
  without a request id - a radix eviction - releases every holder), the last one is an allocation.
  Prefix-cache hits hold a page too (shared).
* F5: a ``kv_read`` by R of a page R does not hold. F7: a ``kv_written`` attributed to R on a page R
  does not hold. F6: an allocation (not a prefix hit) of a page another request holds. Victims are
  the page's holders at that moment.
* F2/F4/F8 mirror the replay engine's joins by ``transfer_id`` / ``request_id``.

The window is the replay engine's: each producer is read from its last ``node_config`` at or before
``from_ns``; findings ending before ``from_ns`` are dropped.

Known difference: when a page has several exclusive holders and the owner releases it, the replay
engine promotes an arbitrary remaining holder (``set.pop``); F6 evidence here promotes the earliest.
"""

from __future__ import annotations

from kvtrail.forensics.findings import Finding, make_finding
from kvtrail.forensics.replay import window_filter

_EVENT_COLS = ("producer_id, seq, wall_ns, kind, request_id, transfer_id, tenant_id, purpose, num_tokens, "
               "num_pages, num_dst_pages, status, http_status, stage, abort_reason, pool_tokens, "
               "context_tokens, cluster, node, instance")
_PAGE_KINDS = "('pages_allocated', 'pages_freed', 'kv_written', 'kv_read')"


def _base(where: str) -> str:
    """CTEs shared by every query: windowed events (ev), pool epochs, page runs of page events (pr)."""
    return f"""
    ev AS (SELECT {_EVENT_COLS},
                  row_number() OVER (ORDER BY wall_ns, cluster, node, instance, seq) AS ord
           FROM events_v WHERE {where}),
    cfg AS (SELECT cluster, node, ord,
                   sum(CASE WHEN instance IS DISTINCT FROM prev THEN 1 ELSE 0 END)
                       OVER (PARTITION BY cluster, node ORDER BY ord) AS epoch
            FROM (SELECT cluster, node, ord, instance,
                         lag(instance) OVER (PARTITION BY cluster, node ORDER BY ord) AS prev
                  FROM ev WHERE kind = 'node_config')),
    pe AS (SELECT e.*, c.epoch FROM ev e ASOF JOIN cfg c
           ON e.cluster = c.cluster AND e.node = c.node AND e.ord >= c.ord
           WHERE e.kind IN {_PAGE_KINDS}),
    pr AS (SELECT pe.cluster, pe.node, pe.epoch, pe.ord, pe.producer_id, pe.seq, pe.wall_ns, pe.kind,
                  pe.request_id, pe.purpose, pe.num_pages AS ev_pages, r.pos, r.page_start,
                  r.page_start + r.num_pages - 1 AS page_end
           FROM pe JOIN page_runs r ON r.producer_id = pe.producer_id AND r.seq = pe.seq AND r.list = 0),
    mem AS (SELECT *, kind = 'pages_allocated' AS is_alloc,
                   kind = 'pages_allocated' AND purpose IS DISTINCT FROM 'prefix_hit' AS exclusive
            FROM pr WHERE kind IN ('pages_allocated', 'pages_freed'))"""


def _holders(probe: str, other_only: bool) -> str:
    """CTE text: holders of each probed page at the probe's ord.

    ``probe`` names a relation of page runs (probe_id, cluster, node, epoch, ord, request_id,
    page_start, page_end); only pages where a probe run overlaps an earlier allocation run are
    expanded. Yields (probe_id, page, holder, exclusive_holder). With ``other_only`` the probing
    request itself is left out.
    """
    other = "AND m.request_id IS DISTINCT FROM q.request_id" if other_only else ""
    return f"""
    cand AS (SELECT q.probe_id, q.cluster, q.node, q.epoch, q.ord, g.page, m.request_id AS holder,
                    max(m.ord) AS last_alloc
             FROM {probe} q JOIN mem m
               ON m.is_alloc AND m.cluster = q.cluster AND m.node = q.node AND m.epoch = q.epoch
              AND m.ord < q.ord AND m.page_start <= q.page_end AND q.page_start <= m.page_end {other},
             generate_series(greatest(q.page_start, m.page_start), least(q.page_end, m.page_end)) AS g(page)
             GROUP BY ALL),
    dropped AS (SELECT c.probe_id, c.page, c.holder, max(f.ord) AS last_drop
                FROM cand c JOIN mem f
                  ON NOT f.is_alloc AND f.cluster = c.cluster AND f.node = c.node AND f.epoch = c.epoch
                 AND f.ord < c.ord AND c.page BETWEEN f.page_start AND f.page_end
                 AND (f.request_id = c.holder OR f.request_id IS NULL)
                GROUP BY ALL),
    held AS (SELECT c.probe_id, c.page, c.holder,
                    EXISTS (SELECT 1 FROM mem x WHERE x.exclusive AND x.request_id = c.holder
                            AND x.cluster = c.cluster AND x.node = c.node AND x.epoch = c.epoch
                            AND x.ord < c.ord AND x.ord > coalesce(d.last_drop, -1)
                            AND c.page BETWEEN x.page_start AND x.page_end) AS exclusive_holder
             FROM cand c LEFT JOIN dropped d USING (probe_id, page, holder)
             WHERE d.last_drop IS NULL OR d.last_drop < c.last_alloc)"""


def _sorted_ids(ids) -> tuple:
    return tuple(sorted(set(ids), key=lambda x: (x is None, x)))


def _keys(items) -> tuple[tuple[int, int], ...]:
    return tuple(sorted({(int(p), int(s)) for p, s in items}))


class _Ctx:
    def __init__(self, con, where: str, params: list):
        self.con, self.where, self.params = con, where, params
        self.tenants: dict[str, str] = {}

    def query(self, body: str, extra_ctes: str = "") -> list[tuple]:
        sql = "WITH " + _base(self.where) + ("," + extra_ctes if extra_ctes else "") + "\n" + body
        return self.con.execute(sql, self.params).fetchall()

    def finding(self, code, *, node, request=None, victims=(), pages=(), first_ns, last_ns, evidence, detail):
        vic = _sorted_ids(victims)
        return make_finding(code, node=node, request_id=request, tenant_id=self.tenants.get(request),
                            victim_request_ids=vic, victim_tenant_ids=tuple(self.tenants.get(v) for v in vic),
                            pages=tuple(int(p) for p in pages), first_ns=int(first_ns), last_ns=int(last_ns),
                            evidence=_keys(evidence), detail=detail)


def _f8(ctx: _Ctx) -> list[Finding]:
    rows = ctx.query("SELECT node, wall_ns, producer_id, seq, pool_tokens, context_tokens FROM ev "
                     "WHERE kind = 'node_config' AND pool_tokens < context_tokens")
    return [ctx.finding("F8", node=n, first_ns=w, last_ns=w, evidence=[(p, s)],
                        detail=f"pool holds {pt} tokens, context is {ct}") for n, w, p, s, pt, ct in rows]


def _f2(ctx: _Ctx) -> list[Finding]:
    """Per transfer_id: the last reservation and receipt (by ord), every send; as the replay engine."""
    rows = ctx.query("""
    SELECT rec.node, rec.request_id, rec.wall_ns, res.num_tokens, res.num_pages, s.tokens, s.dst_pages, s.n,
           rec.num_tokens, least(rec.wall_ns, res.wall_ns, coalesce(s.first_ns, rec.wall_ns)),
           [rec.producer_id, rec.seq::BIGINT], [res.producer_id, res.seq::BIGINT], s.keys,
           (SELECT list(g.page ORDER BY r.pos, g.page) FROM page_runs r,
                   generate_series(r.page_start, r.page_start + r.num_pages - 1) AS g(page)
            WHERE r.producer_id = res.producer_id AND r.seq = res.seq AND r.list = 0) AS res_pages
    FROM (SELECT * FROM ev WHERE kind = 'transfer_received' 
          QUALIFY row_number() OVER (PARTITION BY transfer_id ORDER BY ord DESC) = 1) rec
    JOIN (SELECT * FROM ev WHERE kind = 'transfer_reserved' 
          QUALIFY row_number() OVER (PARTITION BY transfer_id ORDER BY ord DESC) = 1) res
      ON res.transfer_id IS NOT DISTINCT FROM rec.transfer_id
    LEFT JOIN (SELECT transfer_id, sum(num_tokens) AS tokens, sum(num_dst_pages) AS dst_pages, count(*) AS n,
                      min(wall_ns) AS first_ns, list([producer_id, seq::BIGINT]) AS keys
               FROM ev WHERE kind = 'transfer_sent' GROUP BY transfer_id) s
      ON s.transfer_id IS NOT DISTINCT FROM rec.transfer_id
    WHERE rec.status IN ('ok', 'mismatch')""")
    out = []
    for (node, rid, wall, res_tok, res_np, s_tok, s_np, n_sent, rec_tok, first, rec_key, res_key, s_keys,
         res_pages) in rows:
        problems = []
        if n_sent and (s_tok != res_tok or s_np != res_np):
            problems.append(f"sent {s_tok} tokens/{s_np} pages")
        if rec_tok != res_tok:
            problems.append(f"received {rec_tok} tokens")
        if problems:
            out.append(ctx.finding("F2", node=node, request=rid, pages=res_pages or (), first_ns=first, last_ns=wall,
                                   evidence=[rec_key, res_key, *(s_keys or ())],
                                   detail=f"reserved {res_tok} tokens/{res_np} pages; " + ", ".join(problems)))
    return out


def _f4(ctx: _Ctx) -> list[Finding]:
    """A 2xx response whose request_id or transfer_id matches a request_aborted event."""
    rows = ctx.query("""
    SELECT r.node, r.request_id, r.wall_ns, r.http_status, r.producer_id, r.seq,
           min(a.wall_ns), list(DISTINCT [a.producer_id, a.seq::BIGINT]),
           list(DISTINCT a.stage || ': ' || a.abort_reason || ' (' || a.http_status || ')')
    FROM ev r JOIN ev a
      ON a.kind = 'request_aborted'
     AND (a.request_id = r.request_id OR (a.transfer_id = r.transfer_id))
    WHERE r.kind = 'response_sent' AND r.http_status BETWEEN 200 AND 299
    GROUP BY r.node, r.request_id, r.wall_ns, r.http_status, r.producer_id, r.seq""")
    return [ctx.finding("F4", node=n, request=rid, first_ns=first, last_ns=w, evidence=[(p, s), *keys],
                        detail=f"HTTP {st} after abort: " + "; ".join(sorted(x for x in what if x is not None)))
            for n, rid, w, st, p, s, first, keys, what in rows]


def _f5_f7(ctx: _Ctx) -> list[Finding]:
    """Reads (F5) and writes (F7) of pages the request does not hold at that moment."""
    ctes = """
    acc AS (SELECT * FROM pr WHERE kind IN ('kv_read', 'kv_written')),
    ov AS (SELECT a.producer_id, a.seq, g.page, arg_max(m.is_alloc, m.ord) AS held
           FROM acc a JOIN mem m
             ON m.cluster = a.cluster AND m.node = a.node AND m.epoch = a.epoch AND m.ord < a.ord
            AND (m.request_id = a.request_id OR (NOT m.is_alloc AND m.request_id IS NULL))
            AND m.page_start <= a.page_end AND a.page_start <= m.page_end,
           generate_series(greatest(a.page_start, m.page_start), least(a.page_end, m.page_end)) AS g(page)
           GROUP BY ALL),
    bad_ev AS (SELECT a.producer_id, a.seq FROM (SELECT DISTINCT producer_id, seq, ev_pages FROM acc) a
               LEFT JOIN (SELECT producer_id, seq, count(*) FILTER (WHERE held) AS n FROM ov GROUP BY ALL) h
               USING (producer_id, seq)
               WHERE coalesce(h.n, 0) < a.ev_pages),
    outside AS (SELECT a.producer_id, a.seq, a.cluster, a.node, a.epoch, a.ord, a.request_id, a.kind,
                       a.wall_ns, g.page, a.pos + g.page - a.page_start AS idx,
                       a.producer_id || ':' || a.seq || ':' || g.page AS probe_id,
                       g.page AS page_start, g.page AS page_end
                FROM acc a SEMI JOIN bad_ev USING (producer_id, seq),
                     generate_series(a.page_start, a.page_end) AS g(page)
                ANTI JOIN (SELECT * FROM ov WHERE held) o
                  ON o.producer_id = a.producer_id AND o.seq = a.seq AND o.page = g.page),
    """ + _holders("outside", other_only=False) + """,
    ever AS (SELECT DISTINCT o.producer_id, o.seq, o.page FROM outside o JOIN mem m
               ON m.is_alloc AND m.request_id = o.request_id AND m.cluster = o.cluster AND m.node = o.node
              AND m.epoch = o.epoch AND m.ord < o.ord AND o.page BETWEEN m.page_start AND m.page_end)"""
    rows = ctx.query("""
    SELECT o.kind, o.node, o.request_id, o.wall_ns, o.producer_id, o.seq,
           list(o.page ORDER BY o.idx), list(h.holders) , bool_and(e.page IS NOT NULL)
    FROM outside o
    LEFT JOIN (SELECT probe_id, list(holder) AS holders FROM held GROUP BY probe_id) h USING (probe_id)
    LEFT JOIN ever e ON e.producer_id = o.producer_id AND e.seq = o.seq AND e.page = o.page
    GROUP BY o.kind, o.node, o.request_id, o.wall_ns, o.producer_id, o.seq""", ctes)
    out = []
    for kind, node, rid, wall, pid, seq, pages, holders, was_held in rows:
        victims = [v for hs in holders if hs for v in hs]
        if kind == "kv_read":
            out.append(ctx.finding("F5", node=node, request=rid, victims=victims, pages=pages, first_ns=wall,
                                   last_ns=wall, evidence=[(pid, seq)],
                                   detail="read of pages the request does not hold"))
        else:
            why = "after the request released them" if was_held else "on pages the request never held"
            out.append(ctx.finding("F7", node=node, request=rid, victims=victims, pages=pages, first_ns=wall,
                                   last_ns=wall, evidence=[(pid, seq)], detail=f"write {why}"))
    return out


def _f6(ctx: _Ctx) -> list[Finding]:
    """Exclusive allocations of pages another request still holds."""
    ctes = """
    probe AS (SELECT *, producer_id || ':' || seq AS probe_id FROM mem WHERE exclusive),
    """ + _holders("probe", other_only=True)
    rows = ctx.query("""
    SELECT p.producer_id, p.seq, p.node, p.cluster, p.epoch, p.ord, p.request_id, p.wall_ns, p.purpose,
           list(DISTINCT h.page), list(DISTINCT h.holder)
    FROM held h JOIN probe p ON p.probe_id = h.probe_id AND h.page BETWEEN p.page_start AND p.page_end
    GROUP BY ALL""", ctes)
    by_event: dict = {}
    for pid, seq, node, cluster, epoch, ord_, rid, wall, purpose, pages, holders in rows:
        e = by_event.setdefault((pid, seq), dict(node=node, cluster=cluster, epoch=epoch, ord=ord_, rid=rid,
                                                 wall=wall, purpose=purpose, pages=[], holders=set()))
        e["pages"] += pages
        e["holders"] |= set(holders)
    out = []
    for key, e in by_event.items():
        pages = _event_order(ctx, key, e["pages"])
        evidence = [key, *_owner_alloc_events(ctx, e, pages)]
        out.append(ctx.finding("F6", node=e["node"], request=e["rid"], victims=e["holders"], pages=pages,
                               first_ns=e["wall"], last_ns=e["wall"], evidence=evidence,
                               detail=f"allocated ({e['purpose']}) while still held"))
    return out


def _event_order(ctx: _Ctx, key, pages) -> list[int]:
    """The given pages of one event in the order the event lists them."""
    rows = ctx.con.execute(
        "SELECT g.page FROM page_runs r, generate_series(r.page_start, r.page_start + r.num_pages - 1) AS g(page) "
        "WHERE r.producer_id = ? AND r.seq = ? AND r.list = 0 AND list_contains(?, g.page) ORDER BY r.pos, g.page",
        [key[0], key[1], list(pages)]).fetchall()
    return [r[0] for r in rows]


def _owner_alloc_events(ctx: _Ctx, e: dict, pages) -> list[tuple[int, int]]:
    """For each busy page with an exclusive owner: the allocation that made the current owner own it.

    Folds the page's earlier allocations and releases in order (owner, then further exclusive holders
    in arrival order; a release by the owner promotes the earliest further holder, whose promotion
    does not change the recorded allocation event).
    """
    rows = _fold_rows(ctx, e, pages)
    out = []
    state: dict[int, tuple] = {}
    for page, _, is_alloc, exclusive, rid, pid, seq in rows:
        owner, extra, alloc_ev = state.get(page, (None, [], None))
        extra = list(extra)
        if is_alloc:
            if exclusive:
                if owner is None or owner == rid:
                    owner, alloc_ev = rid, (pid, seq)
                elif rid not in extra:
                    extra.append(rid)
        elif rid is None:
            owner, extra = None, []
        else:
            if rid in extra:
                extra.remove(rid)
            if owner == rid:
                owner = extra.pop(0) if extra else None
        state[page] = (owner, extra, alloc_ev)
    for page in pages:
        owner, _, alloc_ev = state.get(page, (None, [], None))
        if owner is not None and alloc_ev is not None:
            out.append(alloc_ev)
    return out


def _fold_rows(ctx: _Ctx, e: dict, pages) -> list[tuple]:
    """Allocations and releases of the given pages before the event, page by page in order."""
    lo, hi = min(pages), max(pages)
    sql = ("WITH " + _base(ctx.where) + """
    SELECT g.page, m.ord, m.is_alloc, m.exclusive, m.request_id, m.producer_id, m.seq
    FROM mem m, generate_series(greatest(m.page_start, ?), least(m.page_end, ?)) AS g(page)
    WHERE m.cluster = ? AND m.node = ? AND m.epoch = ? AND m.ord < ?
      AND m.page_start <= ? AND ? <= m.page_end AND list_contains(?, g.page)
    ORDER BY g.page, m.ord""")
    params = ctx.params + [lo, hi, e["cluster"], e["node"], e["epoch"], e["ord"], hi, lo, list(pages)]
    return ctx.con.execute(sql, params).fetchall()


def sql_findings(con, from_ns: int | None = None, to_ns: int | None = None) -> list[Finding]:
    """F2, F4, F5, F6, F7 and F8 findings of the events in [from_ns, to_ns], computed in SQL.

    Same window, same :class:`Finding` fields and ordering as :func:`replay_store`.
    """
    where, params = window_filter(from_ns, to_ns)
    con.complete()
    con.begin()  # one snapshot for every query
    try:
        ctx = _Ctx(con, where, params)
        ctx.tenants = dict(ctx.query(
            "SELECT request_id, arg_min(tenant_id, ord) FROM ev WHERE request_id IS NOT NULL "
            "AND tenant_id IS NOT NULL GROUP BY request_id"))
        found = _f8(ctx) + _f2(ctx) + _f4(ctx) + _f5_f7(ctx) + _f6(ctx)
    finally:
        con.commit()
    found = [f for f in found if from_ns is None or f.last_ns >= from_ns]
    return sorted(found, key=lambda f: (f.last_ns, f.first_ns, int(f.code[1:]), f.evidence))
