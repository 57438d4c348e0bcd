"""Exposure: who read whose data, from the affected responses' findings.

One row per (recipient, victim, page) is the raw material; the recipient x victim tenant matrix and
the per-victim-tenant list (who must be notified) are aggregates of it.
"""

from __future__ import annotations

import polars as pl

from kvtrail.forensics.findings import AFFECTED_CODES, NEVER_WRITTEN, UNKNOWN_TENANT

PSEUDO_VICTIMS = (NEVER_WRITTEN, UNKNOWN_TENANT)


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

