"""The SQL engine's page findings: F1, F5, F6, F7 and F10 as range joins over ``page_runs``.

Runs of two events are joined by node, pool epoch and overlapping page ranges
(``a.page_start <= b.page_end AND b.page_start <= a.page_end``); only the overlap of two runs is
expanded to single pages. Each function takes the engine's query context (:class:`kvtrail.forensics.sql.engine.Ctx`)
and returns findings; the rules are restated in :mod:`kvtrail.forensics.sql.engine`.
"""

from __future__ import annotations

from kvtrail.forensics.findings import (
    REPEAT_DETAIL,
    Finding,
    foreign_read_detail,
    late_write_detail,
    unknown_writer_detail,
)


def holders_ctes(probe: str, other_only: bool) -> str:
    """CTE text: holders of each probed page at the probe's ord.

    ``probe`` names a relation of page runs (probe_id, cluster, node, epoch, ord, request_id,
    page_start, page_end); only pages where a probe run overlaps an earlier allocation run are
    expanded. Yields (probe_id, page, holder, exclusive_holder). With ``other_only`` the probing
    request itself is left out.
    """
    other = "AND m.request_id IS DISTINCT FROM q.request_id" if other_only else ""
    return f"""
    cand AS (SELECT q.probe_id, q.cluster, q.node, q.epoch, q.ord, q.bucket, g.page, m.request_id AS holder,
                    max(m.ord) AS last_alloc
             FROM {probe} q JOIN mem m
               ON m.is_alloc AND m.cluster = q.cluster AND m.node = q.node AND m.epoch = q.epoch
              AND m.bucket = q.bucket AND m.ord < q.ord
              AND m.page_start <= q.page_end AND q.page_start <= m.page_end {other},
             generate_series(greatest(q.page_start, m.page_start), least(q.page_end, m.page_end)) AS g(page)
             GROUP BY ALL),
    dropped AS (SELECT c.probe_id, c.page, c.holder, max(f.ord) AS last_drop
                FROM cand c JOIN mem f
                  ON NOT f.is_alloc AND f.cluster = c.cluster AND f.node = c.node AND f.epoch = c.epoch
                 AND f.bucket = c.bucket AND f.ord < c.ord AND c.page BETWEEN f.page_start AND f.page_end
                 AND (f.request_id = c.holder OR f.request_id IS NULL)
                GROUP BY ALL),
    held AS (SELECT c.probe_id, c.page, c.holder,
                    EXISTS (SELECT 1 FROM mem x WHERE x.exclusive AND x.request_id = c.holder
                            AND x.cluster = c.cluster AND x.node = c.node AND x.epoch = c.epoch
                            AND x.bucket = c.bucket AND x.ord < c.ord AND x.ord > coalesce(d.last_drop, -1)
                            AND c.page BETWEEN x.page_start AND x.page_end) AS exclusive_holder
             FROM cand c LEFT JOIN dropped d USING (probe_id, page, holder)
             WHERE d.last_drop IS NULL OR d.last_drop < c.last_alloc)"""


def f5_f7(ctx) -> list[Finding]:
    """Reads (F5) and writes (F7) of pages the request does not hold at that moment."""
    ctes = (
        """
    acc AS (SELECT * FROM pr WHERE kind IN ('kv_read', 'kv_written')),
    ov AS (SELECT a.producer_id, a.seq, g.page, arg_max(m.is_alloc, m.ord) AS held
           FROM acc a JOIN mem m
             ON m.cluster = a.cluster AND m.node = a.node AND m.epoch = a.epoch AND m.bucket = a.bucket
            AND m.ord < a.ord
            AND (m.request_id = a.request_id OR (NOT m.is_alloc AND m.request_id IS NULL))
            AND m.page_start <= a.page_end AND a.page_start <= m.page_end,
           generate_series(greatest(a.page_start, m.page_start), least(a.page_end, m.page_end)) AS g(page)
           GROUP BY ALL),
    bad_ev AS (SELECT a.producer_id, a.seq FROM (SELECT DISTINCT producer_id, seq, ev_pages FROM acc) a
               LEFT JOIN (SELECT producer_id, seq, count(*) FILTER (WHERE held) AS n FROM ov GROUP BY ALL) h
               USING (producer_id, seq)
               WHERE coalesce(h.n, 0) < a.ev_pages),
    outside AS (SELECT a.producer_id, a.seq, a.cluster, a.node, a.epoch, a.bucket, a.ord, a.request_id, a.kind,
                       a.wall_ns, g.page, a.pos + g.page - a.page_start AS idx,
                       a.producer_id || ':' || a.seq || ':' || g.page AS probe_id,
                       g.page AS page_start, g.page AS page_end
                FROM acc a SEMI JOIN bad_ev USING (producer_id, seq),
                     generate_series(a.page_start, a.page_end) AS g(page)
                ANTI JOIN (SELECT * FROM ov WHERE held) o
                  ON o.producer_id = a.producer_id AND o.seq = a.seq AND o.page = g.page),
    """
        + holders_ctes("outside", other_only=False)
        + """,
    ever AS (SELECT DISTINCT o.producer_id, o.seq, o.page FROM outside o JOIN mem m
               ON m.is_alloc AND m.request_id = o.request_id AND m.cluster = o.cluster AND m.node = o.node
              AND m.epoch = o.epoch AND m.bucket = o.bucket AND m.ord < o.ord
              AND o.page BETWEEN m.page_start AND m.page_end)"""
    )
    rows = ctx.query(
        """
    SELECT o.kind, o.node, o.request_id, o.wall_ns, o.producer_id, o.seq,
           list(o.page ORDER BY o.idx), list(h.holders) , bool_and(e.page IS NOT NULL)
    FROM outside o
    LEFT JOIN (SELECT probe_id, list(holder) AS holders FROM held GROUP BY probe_id) h USING (probe_id)
    LEFT JOIN ever e ON e.producer_id = o.producer_id AND e.seq = o.seq AND e.page = o.page
    GROUP BY o.kind, o.node, o.request_id, o.wall_ns, o.producer_id, o.seq""",
        ctes,
    )
    out = []
    for kind, node, rid, wall, pid, seq, pages, holders, was_held in rows:
        victims = [v for hs in holders if hs for v in hs]
        if kind == "kv_read":
            out.append(
                ctx.finding(
                    "F5",
                    node=node,
                    request=rid,
                    victims=victims,
                    pages=pages,
                    first_ns=wall,
                    last_ns=wall,
                    evidence=[(pid, seq)],
                    detail="read of pages the request does not hold",
                )
            )
        else:
            why = "after the request released them" if was_held else "on pages the request never held"
            out.append(
                ctx.finding(
                    "F7",
                    node=node,
                    request=rid,
                    victims=victims,
                    pages=pages,
                    first_ns=wall,
                    last_ns=wall,
                    evidence=[(pid, seq)],
                    detail=late_write_detail(why),
                )
            )
    return out


def f6_holders_ctes(probe: str) -> str:
    """CTE text ``held`` (probe_id, page, holder): the other requests holding each probed page at the probe's
    ord, as :func:`holders_ctes` finds them, without expanding every earlier allocation of the page.

    H holds p at t when some allocation of p by H before t has no release of p by H (or without a
    request) between it and t. Each (probe run, earlier allocation run of another request) pair is first
    checked as runs: one such release run covering the whole overlap rules the pair out without
    expanding it (the common case, the holder freed the pages before the probe allocated them). Only
    the pairs left are expanded, page by page, against the releases in between.
    """
    return f"""
    pairs AS (SELECT q.probe_id, q.cluster, q.node, q.epoch, q.bucket, q.ord AS q_ord, m.ord AS a_ord,
                     m.request_id AS holder, greatest(q.page_start, m.page_start) AS lo,
                     least(q.page_end, m.page_end) AS hi
              FROM {probe} q JOIN mem m
                ON m.is_alloc AND m.cluster = q.cluster AND m.node = q.node AND m.epoch = q.epoch
               AND m.bucket = q.bucket AND m.ord < q.ord
               AND m.page_start <= q.page_end AND q.page_start <= m.page_end
               AND m.request_id IS DISTINCT FROM q.request_id),
    rel AS (SELECT * FROM mem WHERE NOT is_alloc),
    open_pairs AS (SELECT * FROM pairs p ANTI JOIN rel f
                     ON f.cluster = p.cluster AND f.node = p.node AND f.epoch = p.epoch AND f.bucket = p.bucket
                    AND (f.request_id = p.holder OR f.request_id IS NULL)
                    AND f.ord > p.a_ord AND f.ord < p.q_ord AND f.page_start <= p.lo AND f.page_end >= p.hi),
    open_pages AS (SELECT o.*, g.page FROM open_pairs o, generate_series(o.lo, o.hi) AS g(page)),
    held AS (SELECT DISTINCT o.probe_id, o.page, o.holder FROM open_pages o ANTI JOIN rel f
               ON f.cluster = o.cluster AND f.node = o.node AND f.epoch = o.epoch AND f.bucket = o.bucket
              AND (f.request_id = o.holder OR f.request_id IS NULL)
              AND f.ord > o.a_ord AND f.ord < o.q_ord AND o.page BETWEEN f.page_start AND f.page_end)"""


def f6(ctx) -> list[Finding]:
    """Exclusive allocations of pages another request still holds."""
    ctes = """
    probe AS (SELECT *, producer_id || ':' || seq AS probe_id FROM mem WHERE exclusive),
    """ + f6_holders_ctes("probe")
    rows = ctx.query(
        """
    SELECT p.producer_id, p.seq, p.node, p.cluster, p.epoch, p.ord, p.request_id, p.wall_ns, p.purpose,
           list(DISTINCT h.page), list(DISTINCT h.holder)
    FROM held h JOIN probe p ON p.probe_id = h.probe_id AND h.page BETWEEN p.page_start AND p.page_end
    GROUP BY ALL""",
        ctes,
    )
    by_event: dict = {}
    for pid, seq, node, cluster, epoch, ord_, rid, wall, purpose, pages, holders in rows:
        e = by_event.setdefault(
            (pid, seq),
            dict(
                node=node,
                cluster=cluster,
                epoch=epoch,
                ord=ord_,
                rid=rid,
                wall=wall,
                purpose=purpose,
                pages=[],
                holders=set(),
            ),
        )
        e["pages"] += pages
        e["holders"] |= set(holders)
    out = []
    for key, e in by_event.items():
        pages = _event_order(ctx, key, e["pages"])
        evidence = [key, *_owner_alloc_events(ctx, e, pages)]
        out.append(
            ctx.finding(
                "F6",
                node=e["node"],
                request=e["rid"],
                victims=e["holders"],
                pages=pages,
                first_ns=e["wall"],
                last_ns=e["wall"],
                evidence=evidence,
                detail=f"allocated ({e['purpose']}) while still held",
            )
        )
    return out


def repeats(ctx) -> list[Finding]:
    """Allocations that list a page more than once (F6 on the allocating request itself).

    A run lists consecutive pages, so a repeat is an overlap of two runs of the same event.
    """
    rows = ctx.query("""
    SELECT a.producer_id, a.seq, a.node, a.request_id, a.wall_ns, list(DISTINCT g.page)
    FROM pr a JOIN pr b
      ON b.producer_id = a.producer_id AND b.seq = a.seq AND a.bucket = b.bucket AND a.pos < b.pos
     AND a.page_start <= b.page_end AND b.page_start <= a.page_end,
         generate_series(greatest(a.page_start, b.page_start), least(a.page_end, b.page_end)) AS g(page)
    WHERE a.kind = 'pages_allocated' AND b.kind = 'pages_allocated'
    GROUP BY ALL""")
    return [
        ctx.finding(
            "F6",
            node=node,
            request=rid,
            victims=[rid],
            pages=_event_order(ctx, (pid, seq), pages, True),
            first_ns=wall,
            last_ns=wall,
            evidence=[(pid, seq)],
            detail=REPEAT_DETAIL,
        )
        for pid, seq, node, rid, wall, pages in rows
    ]


def _event_order(ctx, key, pages, first_only: bool = False) -> list[int]:
    """The given pages of one event in the order the event lists them."""
    rows = ctx.con.execute(
        "SELECT g.page FROM page_runs r, "
        "generate_series(r.page_start, r.page_start::BIGINT + r.num_pages - 1) AS g(page) "
        "WHERE r.producer_id = ? AND r.seq = ? AND r.list = 0 AND list_contains(?, g.page) ORDER BY r.pos, g.page",
        [key[0], key[1], list(pages)],
    ).fetchall()
    listed = [r[0] for r in rows]
    return list(dict.fromkeys(listed)) if first_only else listed


def _owner_alloc_events(ctx, e: dict, pages) -> list[tuple[int, int]]:
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


def _fold_rows(ctx, e: dict, pages) -> list[tuple]:
    """Allocations and releases of the given pages before the event, page by page in order."""
    lo, hi = min(pages), max(pages)
    return ctx.query(
        """
    SELECT g.page, m.ord, m.is_alloc, m.exclusive, m.request_id, m.producer_id, m.seq
    FROM mem m, generate_series(greatest(m.page_start, ?), least(m.page_end, ?)) AS g(page)
    WHERE m.cluster = ? AND m.node = ? AND m.epoch = ? AND m.ord < ?
      AND m.page_start <= ? AND ? <= m.page_end AND list_contains(?, g.page)
    ORDER BY g.page, m.ord""",
        params=[lo, hi, e["cluster"], e["node"], e["epoch"], e["ord"], hi, lo, list(pages)],
    )


def f1_f10(ctx, allow_tenant_cache_sharing: bool) -> list[Finding]:
    """Foreign reads (F1) and cross-tenant prefix-cache reads (F10).

    For every page a ``kv_read`` lists: the last write before it (one range join, arg-max by order).
    Pages the reader wrote itself are done; for the rest, the reader's own allocations and releases
    of the page say whether it holds the page and whether as a prefix-cache hit (with the hit's block
    hash), and the page's last exclusive allocation says whether it is a fresh growth page.
    """
    ctes = """
    memx AS (SELECT m.*, e.block_hashes FROM mem m
             LEFT JOIN (SELECT producer_id, seq, block_hashes FROM events WHERE purpose = 'prefix_hit') e
             USING (producer_id, seq)),
    rd AS (SELECT * FROM pr WHERE kind = 'kv_read'),
    wr AS (SELECT pr.* REPLACE (CASE WHEN pr.kind = 'kv_written' THEN pr.request_id END AS request_id),
                  e.block_hashes, e.page_digests FROM pr JOIN events e USING (producer_id, seq)
           WHERE pr.kind IN ('kv_written', 'transfer_received')),
    rp AS (SELECT r.producer_id, r.seq, r.cluster, r.node, r.epoch, r.bucket, r.ord, r.request_id, r.wall_ns, g.page,
                  r.pos + g.page - r.page_start AS idx
           FROM rd r, generate_series(r.page_start, r.page_end) AS g(page)),
    lw AS (SELECT r.producer_id, r.seq, g.page,
                  max_by(struct_pack(rid := w.request_id, pid := w.producer_id, wseq := w.seq::BIGINT,
                                     wns := w.wall_ns, word := w.ord,
                                     bh := w.block_hashes[w.pos + (g.page - w.page_start) + 1],
                                     has_bh := w.block_hashes IS NOT NULL,
                                     dg := w.page_digests[w.pos + (g.page - w.page_start) + 1]), w.ord) AS w
           FROM rd r JOIN wr w
             ON w.cluster = r.cluster AND w.node = r.node AND w.epoch = r.epoch AND w.bucket = r.bucket
            AND w.ord < r.ord
            AND w.page_start <= r.page_end AND r.page_start <= w.page_end,
           generate_series(greatest(r.page_start, w.page_start), least(r.page_end, w.page_end)) AS g(page)
           GROUP BY ALL),
    cand AS (SELECT rp.*, lw.w FROM rp LEFT JOIN lw USING (producer_id, seq, page)
             WHERE lw.w.rid IS DISTINCT FROM rp.request_id),
    own AS (SELECT c.producer_id, c.seq, c.page,
                   max(m.ord) FILTER (WHERE NOT m.is_alloc) AS last_drop,
                   max(m.ord) FILTER (WHERE m.is_alloc) AS last_alloc,
                   max(m.ord) FILTER (WHERE m.is_alloc AND m.purpose = 'prefix_hit') AS last_hit,
                   max_by(m.block_hashes[m.pos + (c.page - m.page_start) + 1], m.ord)
                       FILTER (WHERE m.is_alloc AND m.purpose = 'prefix_hit') AS hit_hash
            FROM cand c JOIN memx m
              ON m.cluster = c.cluster AND m.node = c.node AND m.epoch = c.epoch AND m.bucket = c.bucket
             AND m.ord < c.ord AND (m.request_id = c.request_id OR (NOT m.is_alloc AND m.request_id IS NULL))
             AND c.page BETWEEN m.page_start AND m.page_end
            GROUP BY ALL),
    excl AS (SELECT c.producer_id, c.seq, c.page,
                    max_by(struct_pack(rid := m.request_id, purpose := m.purpose), m.ord) AS a, max(m.ord) AS a_ord
             FROM cand c JOIN memx m
               ON m.exclusive AND m.cluster = c.cluster AND m.node = c.node AND m.epoch = c.epoch
              AND m.bucket = c.bucket AND m.ord < c.ord AND c.page BETWEEN m.page_start AND m.page_end
             GROUP BY ALL),
    judged AS (SELECT c.*,
                      coalesce(o.last_alloc > coalesce(o.last_drop, -1), FALSE) AS held,
                      coalesce(o.last_hit > coalesce(o.last_drop, -1), FALSE) AS is_hit, o.hit_hash,
                      x.a, x.a_ord, re.page_digests[c.idx + 1] AS read_dg
               FROM cand c
               LEFT JOIN own o USING (producer_id, seq, page)
               LEFT JOIN excl x USING (producer_id, seq, page)
               JOIN events re ON re.producer_id = c.producer_id AND re.seq = c.seq),
    cls AS (SELECT *,
                   is_hit AND coalesce(w.has_bh, FALSE) AND w.bh IS NOT DISTINCT FROM hit_hash AS cached,
                   held AND a.rid IS NOT DISTINCT FROM request_id AND a.purpose = 'decode_growth'
                        AND (w.word IS NULL OR w.word < a_ord) AS fresh
            FROM judged),
    f1w AS MATERIALIZED (SELECT * FROM cls WHERE NOT fresh AND NOT cached AND w.rid IS NOT NULL),
    wheld AS (SELECT c.producer_id, c.seq, c.page, arg_max(m.is_alloc, m.ord) AS held
              FROM f1w c JOIN mem m
                ON m.cluster = c.cluster AND m.node = c.node AND m.epoch = c.epoch AND m.bucket = c.bucket
               AND m.ord < c.w.word
               AND (m.request_id = c.w.rid OR (NOT m.is_alloc AND m.request_id IS NULL))
               AND c.page BETWEEN m.page_start AND m.page_end
              GROUP BY ALL),
    pw AS (SELECT c.producer_id, c.seq, c.page, arg_max_null(w.request_id, w.ord) AS prev_rid, max(w.ord) AS prev_ord
           FROM f1w c JOIN wr w
             ON w.cluster = c.cluster AND w.node = c.node AND w.epoch = c.epoch AND w.bucket = c.bucket
            AND w.ord < c.w.word
            AND c.page BETWEEN w.page_start AND w.page_end
           GROUP BY ALL),
    late AS (SELECT DISTINCT c.producer_id, c.seq, c.page,
                    NOT coalesce(h.held, FALSE) AS is_late,
                    NOT coalesce(h.held, FALSE) AND p.prev_rid IS NOT NULL AND p.prev_rid = c.request_id
                        AND (c.a_ord IS NULL OR c.a_ord < p.prev_ord) AS own_lost
             FROM f1w c LEFT JOIN wheld h USING (producer_id, seq, page)
             LEFT JOIN pw p USING (producer_id, seq, page))"""
    rows = ctx.query(
        """
    SELECT producer_id, seq, node, request_id, wall_ns, cached, w.rid, list(page ORDER BY idx),
           min(w.wns), list(DISTINCT [w.pid, w.wseq]) FILTER (WHERE w.pid IS NOT NULL),
           count(*) FILTER (WHERE read_dg IS NOT NULL AND w.dg IS NOT NULL),
           count(*) FILTER (WHERE read_dg IS NOT NULL AND w.dg IS NOT NULL AND read_dg = w.dg),
           count(*) FILTER (WHERE l.is_late), count(*) FILTER (WHERE l.own_lost),
           count(*) FILTER (WHERE w.pid IS NOT NULL AND w.rid IS NULL)
    FROM cls LEFT JOIN late l USING (producer_id, seq, page) WHERE NOT fresh AND (NOT cached OR w.rid IS NOT NULL)
    GROUP BY producer_id, seq, node, request_id, wall_ns, cached, w.rid""",
        ctes,
    )
    out = []
    for (
        pid,
        seq,
        node,
        rid,
        wall,
        cached,
        writer,
        pages,
        first,
        wkeys,
        checked,
        matched,
        num_late,
        num_lost,
        num_unverified,
    ) in rows:
        if not cached:
            if writer is None:  # never written, or landed by an unverified transfer (its receipts are evidence)
                out.append(
                    ctx.finding(
                        "F1",
                        node=node,
                        request=rid,
                        victims=[None],
                        pages=pages,
                        first_ns=wall,
                        last_ns=wall,
                        evidence=[(pid, seq), *(wkeys or ())],
                        detail=unknown_writer_detail(num_unverified),
                    )
                )
            else:
                out.append(
                    ctx.finding(
                        "F1",
                        node=node,
                        request=rid,
                        victims=[writer],
                        pages=pages,
                        first_ns=first,
                        last_ns=wall,
                        evidence=[(pid, seq), *wkeys],
                        detail=foreign_read_detail(ctx.rid(writer), num_late, num_lost),
                        lineage=(checked, matched),
                    )
                )
            continue
        mine, theirs = ctx.tenant(rid), ctx.tenant(writer)
        if allow_tenant_cache_sharing or mine is None or theirs is None or mine == theirs:
            continue
        out.append(
            ctx.finding(
                "F10",
                node=node,
                request=rid,
                victims=[writer],
                pages=pages,
                first_ns=first,
                last_ns=wall,
                evidence=[(pid, seq), *wkeys],
                detail=f"prefix-cache pages written for tenant {theirs} served to tenant {mine}",
            )
        )
    return out
