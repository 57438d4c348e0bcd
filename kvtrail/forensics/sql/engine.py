"""A second, independent findings engine: DuckDB SQL over the audit store (F1-F11).

Where :mod:`kvtrail.forensics.replay.engine` walks events one by one, this module asks the store directly,
restating every rule of ``docs/findings.md`` (the contract both engines are held to) over the record. Page
questions are range joins over ``page_runs`` by node, pool epoch and overlapping page ranges, cut at
multiples of ``PAGE_BUCKET`` pages so DuckDB hashes on (node, epoch, bucket); only the overlap of two runs is
expanded to single pages. A lake runs the page queries per (node, hour) from each partition's checkpoint
(:mod:`kvtrail.forensics.lake.sqltask`, through ``scope``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvtrail.forensics.findings import UNVERIFIED, Finding, make_finding
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.sql.joins import f2, f3, f4, f9, f11
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


def _ev_sql(where: str, order: str) -> str:
    """Windowed events (``ev``): the engine's order numbers and request keys."""
    return f"""
    WITH ev0 AS (SELECT {_EVENT_COLS},
                        row_number() OVER (ORDER BY {order}) AS ord
                 FROM events_v WHERE {where}),
    first_tenant AS (SELECT request_id AS ft_id, arg_min(tenant_id, ord) AS ft_tenant FROM ev0
                     WHERE request_id IS NOT NULL AND tenant_id IS NOT NULL GROUP BY request_id)
    SELECT e.* REPLACE ({REQUEST_KEY} AS request_id), e.request_id AS rid_text,
           coalesce(e.tenant_id, f.ft_tenant) AS rtenant
    FROM ev0 e LEFT JOIN first_tenant f ON f.ft_id = e.request_id"""


def _pe_sql(ev: str) -> str:
    """Page events (``pe``) of the events in ``ev``, each with its node's pool epoch."""
    return f"""
    WITH cfg AS (SELECT cluster, node, ord,
                        sum(CASE WHEN instance IS DISTINCT FROM prev THEN 1 ELSE 0 END)
                            OVER (PARTITION BY cluster, node ORDER BY ord) AS epoch
                 FROM (SELECT cluster, node, ord, instance,
                              lag(instance) OVER (PARTITION BY cluster, node ORDER BY ord) AS prev
                       FROM {ev} WHERE kind = 'node_config'))
    SELECT e.*, c.epoch FROM {ev} e ASOF JOIN cfg c
    ON e.cluster = c.cluster AND e.node = c.node AND e.ord >= c.ord
    WHERE e.kind IN {_PAGE_KINDS} OR (e.kind = 'transfer_received' AND e.status = '{UNVERIFIED}')"""


def _pr_sql(pe: str) -> str:
    """Page runs (``pr``) of the page events in ``pe``, cut at ``PAGE_BUCKET`` boundaries."""
    return f"""
    WITH runs AS (SELECT pe.cluster, pe.node, pe.epoch, pe.ord, pe.producer_id, pe.seq, pe.wall_ns, pe.kind,
                         pe.request_id, pe.purpose, pe.num_pages AS ev_pages, r.pos AS run_pos,
                         r.page_start AS run_start, r.page_start::BIGINT + r.num_pages - 1 AS run_end
                  FROM {pe} AS pe JOIN page_runs r ON r.producer_id = pe.producer_id AND r.seq = pe.seq AND r.list = 0)
    SELECT x.* EXCLUDE (run_pos, run_start, run_end), b.bucket,
           greatest(x.run_start, b.bucket * {PAGE_BUCKET}) AS page_start,
           least(x.run_end, b.bucket * {PAGE_BUCKET} + {PAGE_BUCKET - 1}) AS page_end,
           x.run_pos + greatest(x.run_start, b.bucket * {PAGE_BUCKET}) - x.run_start AS pos
    FROM runs x, generate_series(x.run_start // {PAGE_BUCKET}, x.run_end // {PAGE_BUCKET}) AS b(bucket)"""


# Each call of the engine builds the relations every question shares once, as temporary tables of its own
# connection inside its one read transaction, and drops them with the transaction (one name per call).
_CALLS = itertools.count()


def _shared(ev: str, pe: str, pr: str) -> str:
    """CTEs every query starts with: windowed events (ev), page events (pe), page runs (pr), and
    allocations and releases by page run (mem)."""
    return f"""
    ev AS (SELECT * FROM {ev}),
    pe AS (SELECT * FROM {pe}),
    pr AS (SELECT * FROM {pr}),
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
    """One engine call's questions on ``con``: call inside the call's transaction (the shared relations
    are temporary tables that end with it)."""

    def __init__(self, con, where: str, params: list, order: str = EVENT_ORDER):
        self.con = con
        self.keys: dict[str, tuple[str, str | None]] = {}  # request key -> (request id, tenant)
        tag = f"_kvtrail_sql_{next(_CALLS)}"
        ev, pe, pr = f"{tag}_ev", f"{tag}_pe", f"{tag}_pr"
        con.execute(f"CREATE TEMPORARY TABLE {ev} AS {_ev_sql(where, order)}", list(params))
        con.execute(f"CREATE TEMPORARY TABLE {pe} AS {_pe_sql(ev)}")
        con.execute(f"CREATE TEMPORARY TABLE {pr} AS {_pr_sql(pe)}")
        self._with = "WITH " + _shared(ev, pe, pr)

    def rid(self, key: str | None) -> str | None:
        """The request id of a request key (None: none)."""
        return None if key is None else self.keys[key][0]

    def tenant(self, key: str | None) -> str | None:
        return None if key is None else self.keys[key][1]

    def query(self, body: str, extra_ctes: str = "", params=()) -> list[tuple]:
        sql = self._with + ("," + extra_ctes if extra_ctes else "") + "\n" + body
        return self.con.execute(sql, list(params)).fetchall()

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
        ({"F2"}, f2),
        ({"F3"}, f3),
        ({"F4"}, f4),
        ({"F5", "F7"}, f5_f7),
        ({"F6"}, f6),
        ({"F6"}, repeats),
        ({"F1", "F10"}, lambda c: f1_f10(c, policy.allow_tenant_cache_sharing)),
        ({"F9"}, lambda c: f9(c, policy)),
        ({"F11"}, f11),
    ]
    where, params = window_filter(from_ns, to_ns) if scope is None else (scope.where, list(scope.params))
    order = EVENT_ORDER if scope is None else scope.order
    con.complete()
    con.begin()  # one snapshot for every query; the shared relations end with it
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
        con.rollback()  # the call only reads: this ends its snapshot and drops its temporary tables
    found = [f for f in found if (from_ns is None or f.last_ns >= from_ns) and (want is None or f.code in want)]
    return sorted(found, key=lambda f: (f.last_ns, f.first_ns, int(f.code[1:]), f.evidence))
