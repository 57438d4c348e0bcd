"""Analyses over the answers of ``questions``: exclusions, exposure matrix, threshold analysis.

Every function returns Polars DataFrames (or plain dicts of counts) so the CLI and the disclosure
report print and export the same numbers. Exclusions (internal test accounts, a researcher's
reproduction) remove *recipients* from every count: their reads are not exposure of customer data
to another customer. Data of an excluded account read by someone else still counts as exposed.
The exploitation assessment (``kvtrail.forensics.analysis.exploitation``) is re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import polars as pl

from kvtrail.audit.store import arrow_query
from kvtrail.errors import KvtrailError
from kvtrail.forensics.findings import AFFECTED_CODES

NEVER_WRITTEN = "(never written)"   # a page read before anyone wrote it since the pool was created
UNKNOWN_TENANT = "(unknown tenant)"  # a victim request whose events carry no tenant
PSEUDO_VICTIMS = (NEVER_WRITTEN, UNKNOWN_TENANT)
_MIN_NS, _MAX_NS = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Exclusions:
    """Accounts and requests left out of every count, each ``(id, reason)``."""

    tenants: tuple[tuple[str, str], ...] = ()
    api_key_ids: tuple[tuple[str, str], ...] = ()
    request_ids: tuple[tuple[str, str], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.tenants or self.api_key_ids or self.request_ids)

    def merged(self, other: Exclusions) -> Exclusions:
        """Both lists; for an id listed twice the first reason wins."""
        def merge(a, b):
            seen = dict(a)
            for k, v in b:
                seen.setdefault(k, v)
            return tuple(sorted(seen.items()))
        return Exclusions(merge(self.tenants, other.tenants), merge(self.api_key_ids, other.api_key_ids),
                          merge(self.request_ids, other.request_ids))

    def to_dict(self) -> dict:
        return {name: [{"id": k, "reason": v} for k, v in sorted(getattr(self, name))]
                for name in ("tenants", "api_key_ids", "request_ids")}

    @classmethod
    def from_dict(cls, data: dict) -> Exclusions:
        """Inverse of :meth:`to_dict` (for manifests kvtrail wrote itself)."""
        return cls(*(tuple((e["id"], e["reason"]) for e in data.get(name, ()))
                     for name in ("tenants", "api_key_ids", "request_ids")))


def check_exclusions(con: duckdb.DuckDBPyConnection, excl: Exclusions) -> None:
    """Refuse an excluded tenant the store has never seen (most likely a typo)."""
    if not excl.tenants:
        return
    known = {r[0] for r in con.execute("SELECT DISTINCT tenant_id FROM events_v WHERE tenant_id IS NOT NULL").fetchall()}
    for tenant, _ in excl.tenants:
        if tenant not in known:
            raise KvtrailError(f"exclusions: unknown tenant {tenant!r}; known: {', '.join(sorted(known)[:20])}")


def excluded_requests(con: duckdb.DuckDBPyConnection, excl: Exclusions) -> pl.DataFrame:
    """Every request the exclusions cover: request_id, tenant_id, excluded_by, reason (one row each)."""
    schema = {"request_id": pl.Utf8, "tenant_id": pl.Utf8, "excluded_by": pl.Utf8, "reason": pl.Utf8}
    if excl.empty:
        return pl.DataFrame(schema=schema)
    ids = arrow_query(con, "SELECT DISTINCT request_id, tenant_id, api_key_id FROM events_v "
                           "WHERE request_id IS NOT NULL AND (list_contains(?::VARCHAR[], tenant_id) "
                           "OR list_contains(?::VARCHAR[], api_key_id) OR list_contains(?::VARCHAR[], request_id))",
                      [[t for t, _ in excl.tenants], [k for k, _ in excl.api_key_ids],
                       [r for r, _ in excl.request_ids]]).to_pylist()
    tenants, keys, rids = dict(excl.tenants), dict(excl.api_key_ids), dict(excl.request_ids)
    out: dict[str, dict] = {}
    for r in ids:  # the most specific rule names the reason: request, then API key, then tenant
        rid = r["request_id"]
        if rid in rids:
            by, reason = f"request {rid}", rids[rid]
        elif r["api_key_id"] in keys:
            by, reason = f"api key {r['api_key_id']}", keys[r["api_key_id"]]
        elif r["tenant_id"] in tenants:
            by, reason = f"tenant {r['tenant_id']}", tenants[r["tenant_id"]]
        else:
            continue
        prev = out.get(rid)
        if prev is None or (prev["excluded_by"].startswith("tenant") and not by.startswith("tenant")):
            out[rid] = {"request_id": rid, "tenant_id": r["tenant_id"], "excluded_by": by, "reason": reason}
    return pl.DataFrame(list(out.values()), schema=schema).sort("request_id")


def split_excluded(df: pl.DataFrame, excluded: pl.DataFrame, excl: Exclusions,
                   tenant_col: str = "tenant_id") -> tuple[pl.DataFrame, pl.DataFrame]:
    """(kept rows, excluded rows with ``excluded_by`` and ``reason``) of a frame with request_id/tenant."""
    tenants = dict(excl.tenants)
    marks = df.select("request_id", tenant_col).join(
        excluded.select("request_id", "excluded_by", "reason"), on="request_id", how="left")
    marks = marks.with_columns(
        pl.when(pl.col("excluded_by").is_null() & pl.col(tenant_col).is_in(list(tenants)))
        .then(pl.lit("tenant ") + pl.col(tenant_col)).otherwise(pl.col("excluded_by")).alias("excluded_by"),
        pl.when(pl.col("reason").is_null() & pl.col(tenant_col).is_in(list(tenants)))
        .then(pl.col(tenant_col).replace_strict(tenants, default=None)).otherwise(pl.col("reason")).alias("reason"))
    hit = marks["excluded_by"].is_not_null()
    dropped = df.filter(hit).with_columns(marks.filter(hit).select("excluded_by", "reason"))
    return df.filter(~hit), dropped


def affected_with_exclusions(con: duckdb.DuckDBPyConnection, w, excl: Exclusions, found=None
                             ) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(kept affected responses, excluded ones with reason, every excluded request) for a window
    (``found``: the window's findings, when the caller already has them)."""
    from kvtrail.forensics.questions import affected_responses

    check_exclusions(con, excl)
    excluded = excluded_requests(con, excl)
    kept, dropped = split_excluded(affected_responses(con, w, found), excluded, excl)
    return kept, dropped, excluded


def exposure_links(found: pl.DataFrame, request_ids: set[str]) -> pl.DataFrame:
    """One row per (affected request, victim, page read): the raw material of the exposure matrix.

    A page of an F5/F7 finding with several victims is attributed to each of them; a page nobody
    wrote since the pool was created goes to the pseudo-victim ``(never written)``.
    """
    rows = []
    for f in found.filter(pl.col("code").is_in(sorted(AFFECTED_CODES))).iter_rows(named=True):
        if f["request_id"] not in request_ids:
            continue
        for victim_rid, victim_tenant in zip(f["victim_request_ids"], f["victim_tenant_ids"]):
            victim = victim_tenant if victim_tenant is not None else (
                NEVER_WRITTEN if victim_rid is None else UNKNOWN_TENANT)
            rows += [{"request_id": f["request_id"], "recipient_tenant": f["tenant_id"] or UNKNOWN_TENANT,
                      "victim_tenant": victim, "victim_request_id": victim_rid, "node": f["node"], "page": int(p)}
                     for p in f["pages"]]
    schema = {"request_id": pl.Utf8, "recipient_tenant": pl.Utf8, "victim_tenant": pl.Utf8,
              "victim_request_id": pl.Utf8, "node": pl.Utf8, "page": pl.Int64}
    return pl.DataFrame(rows, schema=schema)


def _page_key() -> pl.Expr:
    return pl.struct("request_id", "node", "page").n_unique()


def exposure_matrix(links: pl.DataFrame) -> pl.DataFrame:
    """Recipient tenant x victim tenant: responses, pages read, distinct victim requests (long form)."""
    return (links.group_by("recipient_tenant", "victim_tenant")
            .agg(pl.col("request_id").n_unique().alias("responses"), _page_key().alias("pages"),
                 pl.col("victim_request_id").drop_nulls().n_unique().alias("victim_requests"))
            .with_columns(pl.col("responses", "pages", "victim_requests").cast(pl.Int64))
            .sort("recipient_tenant", "victim_tenant"))


def exposed_tenants(links: pl.DataFrame) -> pl.DataFrame:
    """Per victim tenant (real tenants only): who read their data, in how many responses and pages."""
    real = links.filter(~pl.col("victim_tenant").is_in(list(PSEUDO_VICTIMS)))
    return (real.group_by("victim_tenant")
            .agg(pl.col("recipient_tenant").unique().sort().str.join(",").alias("recipient_tenants"),
                 pl.col("recipient_tenant").n_unique().alias("recipient_count"),
                 pl.col("request_id").n_unique().alias("responses"), _page_key().alias("pages"),
                 pl.col("victim_request_id").drop_nulls().n_unique().alias("victim_requests"),
                 pl.col("victim_request_id").drop_nulls().unique().sort().str.join(",").alias("victim_request_ids"))
            .with_columns(pl.col("recipient_count", "responses", "pages", "victim_requests").cast(pl.Int64))
            .sort("victim_tenant"))


def node_capacity(con: duckdb.DuckDBPyConnection, from_ns: int | None, to_ns: int | None) -> pl.DataFrame:
    """Pool vs advertised context of every node configuration in effect during the window (F8's numbers)."""
    lo, hi = _MIN_NS if from_ns is None else from_ns, _MAX_NS if to_ns is None else to_ns
    t = arrow_query(con, """
        SELECT node, role, instance, wall_ns AS effective_from_ns, pool_tokens, context_tokens, page_size, pool_pages
        FROM events_v c WHERE kind = 'node_config' AND wall_ns <= ?
          AND wall_ns >= coalesce((SELECT max(wall_ns) FROM events x WHERE x.kind = 'node_config'
                                   AND x.producer_id = c.producer_id AND x.wall_ns <= ?), ?)
        ORDER BY node, wall_ns, instance""", [hi, lo, lo])
    df = pl.from_arrow(t)
    return df.with_columns(
        (pl.col("pool_tokens") >= pl.col("context_tokens")).alias("pool_covers_context"),
        pl.max_horizontal(pl.col("context_tokens") - pl.col("pool_tokens"), pl.lit(0)).alias("shortfall_tokens"))


_REQUESTS_SQL = """
WITH rr AS (
    SELECT request_id, transfer_id, tenant_id, api_key_id, prompt_tokens, wall_ns, role, node, producer_id
    FROM events_v WHERE kind = 'request_received' AND request_id IS NOT NULL
      AND ((wall_ns >= ? AND wall_ns < ?) OR list_contains(?::VARCHAR[], request_id))),
cfg AS (SELECT producer_id, wall_ns, pool_tokens FROM events WHERE kind = 'node_config'),
pre AS (SELECT rr.request_id, rr.transfer_id, rr.node, cfg.pool_tokens
        FROM (SELECT * FROM rr WHERE role = 'prefill') rr
        ASOF LEFT JOIN cfg ON rr.producer_id = cfg.producer_id AND rr.wall_ns >= cfg.wall_ns),
req AS (SELECT request_id, max(tenant_id) AS tenant_id, max(api_key_id) AS api_key_id,
               max(transfer_id) AS transfer_id, max(prompt_tokens) AS prompt_tokens, min(wall_ns) AS received_ns
        FROM rr GROUP BY request_id),
by_rid AS (SELECT request_id, min(node) AS node, min(pool_tokens) AS pool_tokens FROM pre GROUP BY request_id),
by_tid AS (SELECT transfer_id, min(node) AS node, min(pool_tokens) AS pool_tokens FROM pre
           WHERE transfer_id IS NOT NULL GROUP BY transfer_id),
resp AS (SELECT request_id, max(http_status) AS http_status FROM events_v
         WHERE kind = 'response_sent' AND request_id IS NOT NULL GROUP BY request_id)
SELECT req.request_id, req.tenant_id, req.api_key_id, req.prompt_tokens, req.received_ns,
       coalesce(a.node, b.node) AS prefill_node, coalesce(a.pool_tokens, b.pool_tokens) AS prefill_pool_tokens,
       resp.http_status
FROM req LEFT JOIN by_rid a USING (request_id)
LEFT JOIN by_tid b ON a.node IS NULL AND b.transfer_id = req.transfer_id
LEFT JOIN resp USING (request_id)
ORDER BY req.received_ns, req.request_id"""


def requests_table(con: duckdb.DuckDBPyConnection, from_ns: int | None, to_ns: int | None,
                   also: list[str] | tuple[str, ...] = ()) -> pl.DataFrame:
    """Requests received in [from_ns, to_ns) (plus the ids in ``also``): tenant, key, prompt tokens, the
    prefill node they went through and its pool (tokens) at that moment, and the client's HTTP status."""
    lo, hi = _MIN_NS if from_ns is None else from_ns, _MAX_NS if to_ns is None else to_ns
    return pl.from_arrow(arrow_query(con, _REQUESTS_SQL, [lo, hi, list(also)]))


def threshold_analysis(requests: pl.DataFrame, affected_ids: set[str]) -> tuple[pl.DataFrame, dict]:
    """Affected vs unaffected prompts against the prefill pool of their node.

    ``requests`` comes from :func:`requests_table` with excluded requests already removed. Returns a
    per (prefill node, pool) table and a summary dict (see :func:`threshold_sentence`).
    """
    df = requests.with_columns(
        pl.col("request_id").is_in(sorted(affected_ids)).alias("affected"),
        (pl.col("prompt_tokens") > pl.col("prefill_pool_tokens")).alias("over_pool"))
    by_node = (df.filter(pl.col("prefill_node").is_not_null())
               .group_by("prefill_node", "prefill_pool_tokens")
               .agg(pl.len().alias("requests"), pl.col("affected").sum().alias("affected"),
                    (pl.col("affected") & pl.col("over_pool")).sum().alias("affected_over_pool"),
                    (~pl.col("affected") & pl.col("over_pool")).sum().alias("unaffected_over_pool"),
                    pl.col("prompt_tokens").filter(pl.col("affected")).min().alias("min_affected_prompt_tokens"),
                    pl.col("prompt_tokens").filter(~pl.col("affected")).max().alias("max_unaffected_prompt_tokens"))
               .with_columns(pl.col("requests", "affected", "affected_over_pool", "unaffected_over_pool")
                             .cast(pl.Int64))
               .sort("prefill_node", "prefill_pool_tokens"))
    aff, un = df.filter(pl.col("affected")), df.filter(~pl.col("affected"))
    pools = sorted({int(p) for p in aff["prefill_pool_tokens"].drop_nulls()})
    summary = {
        "requests": len(df),
        "affected": len(affected_ids),
        "affected_with_pool": int(aff["prefill_pool_tokens"].is_not_null().sum()),
        "affected_over_pool": int(aff["over_pool"].fill_null(False).sum()),
        "unaffected": len(un),
        "unaffected_with_pool": int(un["prefill_pool_tokens"].is_not_null().sum()),
        "unaffected_over_pool": int(un["over_pool"].fill_null(False).sum()),
        "affected_pool_tokens": pools,
        "min_affected_prompt_tokens": None if aff.is_empty() else _int(aff["prompt_tokens"].min()),
    }
    return by_node, summary


def _int(v) -> int | None:
    return None if v is None else int(v)


def threshold_sentence(s: dict) -> str:
    """The threshold finding in words, e.g. "every affected prompt (155 of 155) was longer than ..."."""
    if s["affected"] == 0:
        return (f"No affected responses; {s['unaffected_over_pool']} of {s['requests']} prompts were longer "
                f"than the prefill pool of their node.")
    pools = " / ".join(f"{p:,}" for p in s["affected_pool_tokens"]) or "unknown"
    n, k = s["affected"], s["affected_over_pool"]
    lead = f"Every affected prompt ({k} of {n}) was" if k == n else f"{k} of {n} affected prompts were"
    text = (f"{lead} longer than the prefill pool of its node ({pools} tokens); "
            f"{s['unaffected_over_pool']} of {s['unaffected']} unaffected prompts were longer.")
    if s["affected_with_pool"] < n:
        text += f" For {n - s['affected_with_pool']} affected responses the prefill node or its pool is unknown."
    return text



# Re-exported so the analyses have one import path.
from kvtrail.forensics.analysis.exploitation import (  # noqa: E402, F401
    ProbeRules, exploitation_assessment, long_prompt_threshold)
