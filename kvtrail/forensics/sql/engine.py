"""A second, independent findings engine: DuckDB SQL over the audit store (F1-F11).

Where :mod:`kvtrail.forensics.replay.engine` walks events one by one, this module asks the store directly,
restating every rule of ``docs/findings.md`` (the contract both engines are held to) over the record. Page
questions are range joins over ``page_runs`` by node, pool epoch and overlapping page ranges, cut at
multiples of ``PAGE_BUCKET`` pages so DuckDB hashes on (node, epoch, bucket); only the overlap of two runs is
expanded to single pages. A lake runs the page queries per (node, hour) from each partition's checkpoint
(:mod:`kvtrail.forensics.lake.sqltask`, through ``scope``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtrail.forensics.findings import (
    UNVERIFIED,
    Finding,
    late_transfer_detail,
    make_finding,
    transfer_mismatch_detail,
)
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.sql.pages import f1_f10, f5_f7, f6, repeats
from kvtrail.forensics.window import window_filter

_EVENT_COLS = (
    "producer_id, seq, wall_ns, kind, request_id, transfer_id, tenant_id, purpose, num_tokens, "
    "num_pages, num_dst_pages, status, http_status, stage, abort_reason, pool_tokens, "
    "context_tokens, cluster, node, instance, role, digest, digest_algo, source, token_start, "
    "token_end, prompt_tokens, completion_tokens, ttft_ns, page_size, release_timeout_ns"
)
_PAGE_KINDS = "('pages_allocated', 'pages_freed', 'kv_written', 'kv_read')"
# The engine's event order (the replay engine's).
EVENT_ORDER = "wall_ns, cluster, node, instance, seq"
# A shared hold that is neither an exclusive allocation nor a prefix-cache hit. No recorded event has
# this purpose (kvtrail.audit.events.ALLOC_PURPOSES): only the events a lake task derives from a
# page-state checkpoint carry it (kvtrail.forensics.lake.prelude).
HOLD_PURPOSE = "_checkpoint_hold"
# Runs are cut at multiples of this many pages (``pr.bucket``): every page join also matches buckets, so
# DuckDB hashes on (node, epoch, bucket) and compares ranges only within a bucket, not a whole pool.
PAGE_BUCKET = 64


@dataclass(frozen=True)
class SqlScope:
    """Which events the engine reads and in what order, where not one store's window: ``where`` with its
    ``params`` filters ``events_v``, ``order`` is the ORDER BY of the engine's order numbers."""

    where: str
    params: tuple = ()
    order: str = EVENT_ORDER


# A request is (its id, its tenant), never the id text alone (clients choose ids: two tenants' requests can
# share one). An event naming no tenant belongs to the request of the first tenant named for its id in the
# engine's order (the replay's ``ReplayState``; ``docs/findings.md``, "Requests"). In the queries below
# ``request_id`` is that key as text: the id's length, the id and the tenant, so no two keys collide whatever
# characters an id holds; ``rid_text`` and ``rtenant`` are its parts.
REQUEST_KEY = (
    "CASE WHEN e.request_id IS NOT NULL THEN length(e.request_id)::VARCHAR || ':' || e.request_id"
    " || coalesce(':' || coalesce(e.tenant_id, f.ft_tenant), '') END"
)


def _base(where: str, order: str) -> str:
    """CTEs shared by every query: windowed events (ev), pool epochs, page runs of page events (pr)."""
    return f"""
    ev0 AS (SELECT {_EVENT_COLS},
                   row_number() OVER (ORDER BY {order}) AS ord
            FROM events_v WHERE {where}),
    first_tenant AS (SELECT request_id AS ft_id, arg_min(tenant_id, ord) AS ft_tenant FROM ev0
                     WHERE request_id IS NOT NULL AND tenant_id IS NOT NULL GROUP BY request_id),
    ev AS (SELECT e.* REPLACE ({REQUEST_KEY} AS request_id), e.request_id AS rid_text,
                  coalesce(e.tenant_id, f.ft_tenant) AS rtenant
           FROM ev0 e LEFT JOIN first_tenant f ON f.ft_id = e.request_id),
    cfg AS (SELECT cluster, node, ord,
                   sum(CASE WHEN instance IS DISTINCT FROM prev THEN 1 ELSE 0 END)
                       OVER (PARTITION BY cluster, node ORDER BY ord) AS epoch
            FROM (SELECT cluster, node, ord, instance,
                         lag(instance) OVER (PARTITION BY cluster, node ORDER BY ord) AS prev
                  FROM ev WHERE kind = 'node_config')),
    pe AS (SELECT e.*, c.epoch FROM ev e ASOF JOIN cfg c
           ON e.cluster = c.cluster AND e.node = c.node AND e.ord >= c.ord
           WHERE e.kind IN {_PAGE_KINDS} OR (e.kind = 'transfer_received' AND e.status = '{UNVERIFIED}')),
    runs AS (SELECT pe.cluster, pe.node, pe.epoch, pe.ord, pe.producer_id, pe.seq, pe.wall_ns, pe.kind,
                    pe.request_id, pe.purpose, pe.num_pages AS ev_pages, r.pos AS run_pos, r.page_start AS run_start,
                    r.page_start + r.num_pages - 1 AS run_end
             FROM pe JOIN page_runs r ON r.producer_id = pe.producer_id AND r.seq = pe.seq AND r.list = 0),
    pr AS (SELECT x.* EXCLUDE (run_pos, run_start, run_end), b.bucket,
                  greatest(x.run_start, b.bucket * {PAGE_BUCKET}) AS page_start,
                  least(x.run_end, b.bucket * {PAGE_BUCKET} + {PAGE_BUCKET - 1}) AS page_end,
                  x.run_pos + greatest(x.run_start, b.bucket * {PAGE_BUCKET}) - x.run_start AS pos
           FROM runs x, generate_series(x.run_start // {PAGE_BUCKET}, x.run_end // {PAGE_BUCKET}) AS b(bucket)),
    mem AS (SELECT *, kind = 'pages_allocated' AS is_alloc,
                   kind = 'pages_allocated' AND purpose IS DISTINCT FROM 'prefix_hit'
                       AND purpose IS DISTINCT FROM '{HOLD_PURPOSE}' AS exclusive
            FROM pr WHERE kind IN ('pages_allocated', 'pages_freed'))"""


def _by_id(v: tuple) -> tuple:
    """Victims' order: by request id, then tenant (no id, no tenant last), as the replay engine."""
    return (v[0] is None, v[0] or "", v[1] is None, v[1] or "")


def _keys(items) -> tuple[tuple[int, int], ...]:
    return tuple(sorted({(int(p), int(s)) for p, s in items}))


class Ctx:
    def __init__(self, con, where: str, params: list, order: str = EVENT_ORDER):
        self.con, self.where, self.params, self.order = con, where, params, order
        self.keys: dict[str, tuple[str, str | None]] = {}  # request key -> (request id, tenant)

    def rid(self, key: str | None) -> str | None:
        """The request id of a request key (None: none)."""
        return None if key is None else self.keys[key][0]

    def tenant(self, key: str | None) -> str | None:
        return None if key is None else self.keys[key][1]

    def query(self, body: str, extra_ctes: str = "", params=()) -> list[tuple]:
        sql = "WITH " + _base(self.where, self.order) + ("," + extra_ctes if extra_ctes else "") + "\n" + body
        return self.con.execute(sql, self.params + list(params)).fetchall()

    def finding(
        self,
        code,
        *,
        node,
        request=None,
        victims=(),
        pages=(),
        first_ns,
        last_ns,
        evidence,
        detail,
        lineage=(0, 0),
        severity=None,
    ):
        vic = sorted({(self.rid(v), self.tenant(v)) for v in victims}, key=_by_id)
        return make_finding(
            code,
            node=node,
            request_id=self.rid(request),
            tenant_id=self.tenant(request),
            victim_request_ids=tuple(v for v, _ in vic),
            victim_tenant_ids=tuple(t for _, t in vic),
            pages=tuple(int(p) for p in pages),
            first_ns=int(first_ns),
            last_ns=int(last_ns),
            evidence=_keys(evidence),
            detail=detail,
            lineage_checked=int(lineage[0]),
            lineage_matched=int(lineage[1]),
            **({"severity": severity} if severity else {}),
        )


def _f8(ctx: Ctx) -> list[Finding]:
    rows = ctx.query(
        "SELECT node, wall_ns, producer_id, seq, pool_tokens, context_tokens FROM ev "
        "WHERE kind = 'node_config' AND pool_tokens < context_tokens"
    )
    return [
        ctx.finding(
            "F8", node=n, first_ns=w, last_ns=w, evidence=[(p, s)], detail=f"pool holds {pt} tokens, context is {ct}"
        )
        for n, w, p, s, pt, ct in rows
    ]


# Transfer events by the transfer they belong to (``docs/findings.md``, "Cross-node rules"): per cluster, transfer id
# and request (``treq``), except a bootstrap room's pair: the one request that only sent a transfer id and the one
# that only reserved or received it, both the cluster's only requests of that id, are one transfer named by the
# receiver's request; ``prefill_rid`` is then the sender's request id.
TRANSFER_CTES = """
    tx AS (SELECT * FROM ev WHERE kind IN ('transfer_reserved', 'transfer_sent', 'transfer_received')),
    legs AS (SELECT cluster, transfer_id, request_id, any_value(rid_text) AS rid_text,
                    bool_or(kind = 'transfer_sent') AS sends, bool_or(kind <> 'transfer_sent') AS receives
             FROM tx WHERE transfer_id IS NOT NULL GROUP BY cluster, transfer_id, request_id),
    rooms AS (SELECT cluster, transfer_id,
                     any_value(request_id) FILTER (WHERE receives) AS d_req,
                     any_value(request_id) FILTER (WHERE sends) AS s_req,
                     any_value(rid_text) FILTER (WHERE sends) AS s_rid
              FROM legs GROUP BY cluster, transfer_id
              HAVING count(*) = 2 AND count(*) FILTER (WHERE sends AND NOT receives) = 1
                 AND count(*) FILTER (WHERE receives AND NOT sends) = 1),
    txk AS (SELECT t.*, coalesce(r.d_req, t.request_id) AS treq, p.s_rid AS prefill_rid
            FROM tx t
            LEFT JOIN rooms r ON r.cluster = t.cluster AND r.transfer_id = t.transfer_id AND r.s_req = t.request_id
            LEFT JOIN rooms p ON p.cluster = t.cluster AND p.transfer_id = t.transfer_id
                             AND p.d_req = coalesce(r.d_req, t.request_id))"""


def _paired(prefill_rid: str | None, detail: str) -> str:
    return detail if prefill_rid is None else f"{detail}; prefill's request id: {prefill_rid}"


def _f2(ctx: Ctx) -> list[Finding]:
    """Per (transfer_id, request_id): the last reservation and receipt (by ord), every send, whatever the
    receipt's status; the request's 2xx responses of the same attempt as evidence (as the replay engine)."""
    rows = ctx.query(
        """
    SELECT rec.node, rec.treq, rec.wall_ns, res.num_tokens, res.num_pages, s.tokens, s.dst_pages, s.n,
           rec.num_tokens, least(rec.wall_ns, res.wall_ns, coalesce(s.first_ns, rec.wall_ns)),
           [rec.producer_id, rec.seq::BIGINT], [res.producer_id, res.seq::BIGINT], s.keys,
           (SELECT list(g.page ORDER BY r.pos, g.page) FROM page_runs r,
                   generate_series(r.page_start, r.page_start + r.num_pages - 1) AS g(page)
            WHERE r.producer_id = res.producer_id AND r.seq = res.seq AND r.list = 0) AS res_pages,
           rec.status,
           (SELECT list([x.http_status::BIGINT, x.completion_tokens, x.producer_id, x.seq::BIGINT]) FROM ev x
            WHERE x.kind = 'response_sent' AND x.http_status BETWEEN 200 AND 299
              AND x.request_id = rec.treq
              AND (x.transfer_id IS NULL OR x.transfer_id = rec.transfer_id)) AS served,
           rec.prefill_rid
    FROM (SELECT * FROM txk WHERE kind = 'transfer_received'
          QUALIFY row_number() OVER (PARTITION BY cluster, transfer_id, treq ORDER BY ord DESC) = 1) rec
    JOIN (SELECT * FROM txk WHERE kind = 'transfer_reserved'
          QUALIFY row_number() OVER (PARTITION BY cluster, transfer_id, treq ORDER BY ord DESC) = 1) res
      ON res.cluster = rec.cluster AND res.transfer_id IS NOT DISTINCT FROM rec.transfer_id
     AND res.treq IS NOT DISTINCT FROM rec.treq
    LEFT JOIN (SELECT cluster, transfer_id, treq, sum(num_tokens) AS tokens, sum(num_dst_pages) AS dst_pages,
                      count(*) AS n, min(wall_ns) AS first_ns, list([producer_id, seq::BIGINT]) AS keys
               FROM txk WHERE kind = 'transfer_sent' GROUP BY cluster, transfer_id, treq) s
      ON s.cluster = rec.cluster AND s.transfer_id IS NOT DISTINCT FROM rec.transfer_id
     AND s.treq IS NOT DISTINCT FROM rec.treq""",
        TRANSFER_CTES,
    )
    out = []
    for (
        node,
        rid,
        wall,
        res_tok,
        res_np,
        s_tok,
        s_np,
        n_sent,
        rec_tok,
        first,
        rec_key,
        res_key,
        s_keys,
        res_pages,
        status,
        served,
        prefill_rid,
    ) in rows:
        problems = []
        if n_sent and (s_tok != res_tok or s_np != res_np):
            problems.append(f"sent {s_tok} tokens/{s_np} pages")
        if rec_tok != res_tok:
            problems.append(f"received {rec_tok} tokens")
        if problems:
            served = served or []
            with_output = any(c > 0 for _, c, _, _ in served)
            out.append(
                ctx.finding(
                    "F2",
                    node=node,
                    request=rid,
                    pages=res_pages or (),
                    first_ns=first,
                    last_ns=wall,
                    evidence=[rec_key, res_key, *(s_keys or ()), *((p, q) for _, _, p, q in served)],
                    severity="critical" if with_output else None,
                    detail=_paired(
                        prefill_rid,
                        transfer_mismatch_detail(res_tok, res_np, problems, status, [(h, c) for h, c, _, _ in served]),
                    ),
                )
            )
    return out


def _f4(ctx: Ctx) -> list[Finding]:
    """A 2xx response with output after a request_aborted of the same request and attempt."""
    rows = ctx.query("""
    SELECT r.node, r.request_id, r.wall_ns, r.http_status, r.producer_id, r.seq,
           min(a.wall_ns), list(DISTINCT [a.producer_id, a.seq::BIGINT]),
           list(DISTINCT a.stage || ': ' || a.abort_reason || ' (' || a.http_status || ')')
    FROM ev r JOIN ev a
      ON a.kind = 'request_aborted' AND a.request_id = r.request_id
     AND (a.transfer_id IS NULL OR r.transfer_id IS NULL OR a.transfer_id = r.transfer_id)
    WHERE r.kind = 'response_sent' AND r.http_status BETWEEN 200 AND 299 AND r.completion_tokens > 0
    GROUP BY r.node, r.request_id, r.wall_ns, r.http_status, r.producer_id, r.seq""")
    return [
        ctx.finding(
            "F4",
            node=n,
            request=rid,
            first_ns=first,
            last_ns=w,
            evidence=[(p, s), *keys],
            detail=f"HTTP {st} after abort: " + "; ".join(sorted(x for x in what if x is not None)),
        )
        for n, rid, w, st, p, s, first, keys, what in rows
    ]


def _f3(ctx: Ctx) -> list[Finding]:
    """Per (transfer_id, request_id): the last receipt (ok or mismatch) against the last send that carried
    a digest."""
    rows = ctx.query(
        """
    SELECT rec.node, rec.treq, rec.wall_ns, rec.status, rec.digest, rec.digest_algo,
           src.digest, src.digest_algo, src.producer_id IS NOT NULL,
           least(rec.wall_ns, coalesce(res.wall_ns, rec.wall_ns), coalesce(s.first_ns, rec.wall_ns)),
           [rec.producer_id, rec.seq::BIGINT], CASE WHEN res.producer_id IS NULL THEN NULL
                                                    ELSE [res.producer_id, res.seq::BIGINT] END, s.keys,
           (SELECT list(g.page ORDER BY r.pos, g.page) FROM page_runs r,
                   generate_series(r.page_start, r.page_start + r.num_pages - 1) AS g(page)
            WHERE r.producer_id = rec.producer_id AND r.seq = rec.seq AND r.list = 0) AS rec_pages,
           rec.prefill_rid
    FROM (SELECT * FROM txk WHERE kind = 'transfer_received'
          QUALIFY row_number() OVER (PARTITION BY cluster, transfer_id, treq ORDER BY ord DESC) = 1) rec
    LEFT JOIN (SELECT * FROM txk WHERE kind = 'transfer_reserved'
               QUALIFY row_number() OVER (PARTITION BY cluster, transfer_id, treq ORDER BY ord DESC) = 1) res
      ON res.cluster = rec.cluster AND res.transfer_id = rec.transfer_id AND res.treq = rec.treq
    LEFT JOIN (SELECT * FROM txk WHERE kind = 'transfer_sent' AND digest IS NOT NULL
               QUALIFY row_number() OVER (PARTITION BY cluster, transfer_id, treq ORDER BY ord DESC) = 1) src
      ON src.cluster = rec.cluster AND src.transfer_id = rec.transfer_id AND src.treq = rec.treq
    LEFT JOIN (SELECT cluster, transfer_id, treq, min(wall_ns) AS first_ns, list([producer_id, seq::BIGINT]) AS keys
               FROM txk WHERE kind = 'transfer_sent' GROUP BY cluster, transfer_id, treq) s
      ON s.cluster = rec.cluster AND s.transfer_id = rec.transfer_id AND s.treq = rec.treq
    WHERE rec.status IN ('ok', 'mismatch')""",
        TRANSFER_CTES,
    )
    out = []
    for node, rid, wall, status, rdg, ralgo, sdg, salgo, has_src, first, rec_key, res_key, s_keys, pages, pf in rows:
        comparable = has_src and rdg is not None and salgo == ralgo
        if comparable and sdg != rdg:
            detail = f"prefill digest {sdg:#x} != decode digest {rdg:#x} ({ralgo})"
        elif not comparable and status == "mismatch":
            detail = "decode reported a digest mismatch"
        else:
            continue
        out.append(
            ctx.finding(
                "F3",
                node=node,
                request=rid,
                pages=pages or (),
                first_ns=first,
                last_ns=wall,
                evidence=[rec_key, *([res_key] if res_key else []), *(s_keys or ())],
                detail=_paired(pf, detail),
            )
        )
    return out


def _f11(ctx: Ctx) -> list[Finding]:
    """Transfers whose span outlasts their decode node's release timeout (as the replay engine's joins)."""
    rows = ctx.query(
        """
    SELECT d.node, d.treq, s.first_ns, greatest(s.last_ns, coalesce(rec_ns, s.last_ns)) AS end_ns,
           c.release_timeout_ns, s.keys, [d.producer_id, d.seq::BIGINT], [c.producer_id, c.seq::BIGINT], d.prefill_rid
    FROM (SELECT cluster, transfer_id, treq, min(wall_ns) AS first_ns, max(wall_ns) AS last_ns,
                 list([producer_id, seq::BIGINT]) AS keys
          FROM txk WHERE kind = 'transfer_sent' GROUP BY cluster, transfer_id, treq) s
    JOIN (SELECT *, CASE WHEN kind = 'transfer_received' THEN wall_ns END AS rec_ns FROM txk
          WHERE kind IN ('transfer_received', 'transfer_reserved')
          QUALIFY row_number() OVER (PARTITION BY cluster, transfer_id, treq
                                     ORDER BY kind = 'transfer_received' DESC, ord DESC) = 1) d
      ON d.cluster = s.cluster AND d.transfer_id IS NOT DISTINCT FROM s.transfer_id
     AND d.treq IS NOT DISTINCT FROM s.treq
    ASOF JOIN (SELECT cluster, node, ord, producer_id, seq, release_timeout_ns FROM ev WHERE kind = 'node_config') c
      ON c.cluster = d.cluster AND c.node = d.node AND d.ord >= c.ord
    WHERE c.release_timeout_ns IS NOT NULL
      AND greatest(s.last_ns, coalesce(rec_ns, s.last_ns)) - s.first_ns > c.release_timeout_ns""",
        TRANSFER_CTES,
    )
    return [
        ctx.finding(
            "F11",
            node=node,
            request=rid,
            first_ns=first,
            last_ns=end,
            evidence=[*keys, dkey, ckey],
            detail=_paired(pf, late_transfer_detail(end - first, node, timeout)),
        )
        for node, rid, first, end, timeout, keys, dkey, ckey, pf in rows
    ]


def _f9(ctx: Ctx, policy: ForensicsPolicy) -> list[Finding]:
    """2xx responses faster than their prefill node's own measured rate allows (see ``ForensicsPolicy``)."""
    ctes = """
    rcv AS (SELECT * FROM ev WHERE kind = 'request_received' AND role IN ('prefill', 'unified')
            QUALIFY row_number() OVER (PARTITION BY cluster, node, request_id ORDER BY ord) = 1),
    rcv_id AS (SELECT cluster, node, rid_text, ord, wall_ns FROM ev
               WHERE kind = 'request_received' AND role IN ('prefill', 'unified')
               QUALIFY row_number() OVER (PARTITION BY cluster, node, rid_text ORDER BY ord) = 1),
    fw AS (SELECT cluster, node, role, rid_text, ord, wall_ns, token_end - token_start AS tokens,
                  lag(wall_ns) OVER (PARTITION BY cluster, node ORDER BY ord) AS prev_ns
           FROM ev WHERE kind = 'kv_written' AND source = 'forward'),
    starts AS (SELECT fw.*, CASE WHEN r.ord < fw.ord THEN r.wall_ns END AS rcv_ns FROM fw
               LEFT JOIN rcv_id r USING (cluster, node, rid_text)),
    samples AS (SELECT cluster, node,
                       tokens::DOUBLE / (wall_ns - greatest(coalesce(prev_ns, rcv_ns), coalesce(rcv_ns, prev_ns)))
                           AS rate
                FROM starts s
                WHERE role IN ('prefill', 'unified') AND tokens > 0
                  AND wall_ns > greatest(coalesce(prev_ns, rcv_ns), coalesce(rcv_ns, prev_ns))
                  AND NOT EXISTS (SELECT 1 FROM ev a WHERE a.kind = 'request_aborted' AND a.cluster = s.cluster
                                  AND a.node = s.node AND a.rid_text = s.rid_text)),
    hits AS (SELECT cluster, node, request_id, sum(num_pages) AS pages FROM pe
             WHERE kind = 'pages_allocated' AND purpose = 'prefix_hit' AND num_pages > 0 GROUP BY ALL),
    psize AS (SELECT cluster, node, arg_max(page_size, ord) AS page_size FROM ev WHERE kind = 'node_config'
              GROUP BY ALL),
    resp AS (SELECT * FROM ev WHERE kind = 'response_sent' AND http_status BETWEEN 200 AND 299
             AND ttft_ns IS NOT NULL AND prompt_tokens IS NOT NULL),
    matched AS (SELECT x.producer_id, x.seq, min_by(r, r.ord) AS r
                FROM resp x JOIN rcv r ON r.request_id = x.request_id
                 AND (r.transfer_id IS NULL OR x.transfer_id IS NULL OR r.transfer_id = x.transfer_id)
                GROUP BY ALL)"""
    rates = {}
    for cluster, node, xs in ctx.query("SELECT cluster, node, list(rate) FROM samples GROUP BY ALL", ctes):
        if len(xs) >= policy.min_latency_samples:
            rates[(cluster, node)] = float(np.quantile(np.array(xs, dtype=np.float64), policy.latency_quantile))
    rows = ctx.query(
        """
    SELECT x.request_id, x.wall_ns, x.producer_id, x.seq, x.ttft_ns,
           x.prompt_tokens - coalesce(h.pages, 0) * coalesce(ps.page_size, 0) AS need,
           m.r.cluster, m.r.node, m.r.producer_id, m.r.seq
    FROM resp x JOIN matched m USING (producer_id, seq)
    LEFT JOIN hits h ON h.cluster = m.r.cluster AND h.node = m.r.node AND h.request_id = m.r.request_id
    LEFT JOIN psize ps ON ps.cluster = m.r.cluster AND ps.node = m.r.node""",
        ctes,
    )
    out = []
    for rid, wall, pid, seq, ttft, need, cluster, node, rpid, rseq in rows:
        rate = rates.get((cluster, node))
        if rate is None or need <= 0:
            continue
        floor_ns = need / rate / policy.latency_factor
        if ttft < floor_ns:
            out.append(
                ctx.finding(
                    "F9",
                    node=node,
                    request=rid,
                    first_ns=wall,
                    last_ns=wall,
                    evidence=[(pid, seq), (rpid, rseq)],
                    detail=f"TTFT {ttft / 1e6:.3f} ms for {need} tokens to prefill; {node} prefills at "
                    f"{rate * 1e9:.0f} tokens/s (q{policy.latency_quantile:g}), so at least "
                    f"{floor_ns / 1e6:.3f} ms (factor {policy.latency_factor:g})",
                )
            )
    return out


def sql_findings(
    con,
    from_ns: int | None = None,
    to_ns: int | None = None,
    policy: ForensicsPolicy = ForensicsPolicy(),
    codes=None,
    *,
    scope: SqlScope | None = None,
) -> list[Finding]:
    """Findings F1-F11 of the events in [from_ns, to_ns], computed in SQL (``codes``: only these).

    Same window, same :class:`Finding` fields and ordering as :func:`replay_store`. ``scope`` replaces
    the window's filter and order (a lake's partition task: its events after a checkpoint's prelude).
    """
    want = set(codes) if codes else None
    parts = [
        ({"F8"}, _f8),
        ({"F2"}, _f2),
        ({"F3"}, _f3),
        ({"F4"}, _f4),
        ({"F5", "F7"}, f5_f7),
        ({"F6"}, f6),
        ({"F6"}, repeats),
        ({"F1", "F10"}, lambda c: f1_f10(c, policy.allow_tenant_cache_sharing)),
        ({"F9"}, lambda c: _f9(c, policy)),
        ({"F11"}, _f11),
    ]
    where, params = window_filter(from_ns, to_ns) if scope is None else (scope.where, list(scope.params))
    order = EVENT_ORDER if scope is None else scope.order
    con.complete()
    con.begin()  # one snapshot for every query
    try:
        ctx = Ctx(con, where, params, order)
        ctx.keys = {
            k: (rid, t)
            for k, rid, t in ctx.query(
                "SELECT DISTINCT request_id, rid_text, rtenant FROM ev WHERE request_id IS NOT NULL"
            )
        }
        found = [f for part_codes, fn in parts if want is None or part_codes & want for f in fn(ctx)]
    finally:
        con.commit()
    found = [f for f in found if (from_ns is None or f.last_ns >= from_ns) and (want is None or f.code in want)]
    return sorted(found, key=lambda f: (f.last_ns, f.first_ns, int(f.code[1:]), f.evidence))
