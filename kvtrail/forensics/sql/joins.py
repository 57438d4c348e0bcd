"""The SQL engine's cross-node rules: F2, F3, F4, F9 and F11 over the store's join kinds (``docs/findings.md``,
"Cross-node rules"; the replay engine's ``replay/joins.py`` states them in Python). Each takes the engine's
query context (``kvtrail.forensics.sql.engine.Ctx``): its ``ev`` relation keys a request by (id, tenant).
"""

from __future__ import annotations

import numpy as np

from kvtrail.forensics.findings import Finding, late_transfer_detail, transfer_mismatch_detail
from kvtrail.forensics.policy import ForensicsPolicy

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


def f2(ctx) -> list[Finding]:
    """Per (transfer_id, request_id): the last reservation and receipt (by ord), every send, whatever the
    receipt's status; the request's 2xx responses of the same attempt as evidence (as the replay engine)."""
    rows = ctx.query(
        """
    SELECT rec.node, rec.treq, rec.wall_ns, res.num_tokens, res.num_pages, s.tokens, s.dst_pages, s.n,
           rec.num_tokens, least(rec.wall_ns, res.wall_ns, coalesce(s.first_ns, rec.wall_ns)),
           [rec.producer_id, rec.seq::BIGINT], [res.producer_id, res.seq::BIGINT], s.keys,
           (SELECT list(g.page ORDER BY r.pos, g.page) FROM page_runs r,
                   generate_series(r.page_start, r.page_start::BIGINT + r.num_pages - 1) AS g(page)
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


def f4(ctx) -> list[Finding]:
    """A 2xx response with output after a request_aborted of the same request and attempt (a bootstrap room's
    prefill and decode ids are one request)."""
    rows = ctx.query(
        """
    SELECT r.node, r.request_id, r.wall_ns, r.http_status, r.producer_id, r.seq,
           min(a.wall_ns), list(DISTINCT [a.producer_id, a.seq::BIGINT]),
           list(DISTINCT a.stage || ': ' || a.abort_reason || ' (' || a.http_status || ')')
    FROM ev r JOIN ab a
      ON a.request_id = r.request_id
     AND (a.transfer_id IS NULL OR r.transfer_id IS NULL OR a.transfer_id = r.transfer_id)
    WHERE r.kind = 'response_sent' AND r.http_status BETWEEN 200 AND 299 AND r.completion_tokens > 0
    GROUP BY r.node, r.request_id, r.wall_ns, r.http_status, r.producer_id, r.seq""",
        TRANSFER_CTES
        + """,
    ab AS (SELECT node, request_id, transfer_id, wall_ns, producer_id, seq, stage, abort_reason, http_status
           FROM ev WHERE kind = 'request_aborted'
           UNION ALL  -- a bootstrap room's prefill abort is its decode request's too (one request, two ids)
           SELECT a.node, m.d_req, a.transfer_id, a.wall_ns, a.producer_id, a.seq, a.stage, a.abort_reason,
                  a.http_status
           FROM ev a JOIN rooms m ON m.cluster = a.cluster AND m.s_req = a.request_id
                                 AND (a.transfer_id IS NULL OR a.transfer_id = m.transfer_id)
           WHERE a.kind = 'request_aborted')""",
    )
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


def f3(ctx) -> list[Finding]:
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
                   generate_series(r.page_start, r.page_start::BIGINT + r.num_pages - 1) AS g(page)
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


def f11(ctx) -> list[Finding]:
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


def f9(ctx, policy: ForensicsPolicy) -> list[Finding]:
    """2xx responses faster than their prefill node's own measured rate allows (see ``ForensicsPolicy``)."""
    ctes = (
        TRANSFER_CTES
        + """,
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
    rcv_for AS (SELECT r.*, r.request_id AS for_req, NULL AS room_cluster FROM rcv r
                UNION ALL  -- a bootstrap room's prefill receipt is its decode request's too
                SELECT r.*, m.d_req, m.cluster FROM rcv r
                JOIN rooms m ON m.cluster = r.cluster AND m.s_req = r.request_id
                             AND (r.transfer_id IS NULL OR r.transfer_id = m.transfer_id)),
    matched AS (SELECT x.producer_id, x.seq, min_by(r, r.ord) AS r
                FROM resp x JOIN rcv_for r ON r.for_req = x.request_id
                 AND (r.room_cluster IS NULL OR r.room_cluster = x.cluster)
                 AND (r.transfer_id IS NULL OR x.transfer_id IS NULL OR r.transfer_id = x.transfer_id)
                GROUP BY ALL)"""
    )
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
