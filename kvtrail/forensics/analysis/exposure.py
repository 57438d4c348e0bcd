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
    # Columnar (one explode per list) rather than a dict per row: a large window has ~10^5 links.
    f = found.filter(pl.col("code").is_in(sorted(AFFECTED_CODES)) & pl.col("request_id").is_in(sorted(request_ids))
                     & (pl.col("victim_request_ids").list.len() > 0) & (pl.col("pages").list.len() > 0))
    v = (f.select("request_id", "tenant_id", "node", "pages", "victim_request_ids", "victim_tenant_ids")
         .explode(["victim_request_ids", "victim_tenant_ids"]).explode("pages"))
    recipient = pl.when(pl.col("tenant_id").is_null() | (pl.col("tenant_id") == "")).then(pl.lit(UNKNOWN_TENANT))
    victim = (pl.when(pl.col("victim_tenant_ids").is_not_null()).then(pl.col("victim_tenant_ids"))
              .when(pl.col("victim_request_ids").is_null()).then(pl.lit(NEVER_WRITTEN))
              .otherwise(pl.lit(UNKNOWN_TENANT)))
    return v.select(pl.col("request_id").cast(pl.Utf8), recipient.otherwise(pl.col("tenant_id")).cast(pl.Utf8)
                    .alias("recipient_tenant"), victim.cast(pl.Utf8).alias("victim_tenant"),
                    pl.col("victim_request_ids").cast(pl.Utf8).alias("victim_request_id"),
                    pl.col("node").cast(pl.Utf8), pl.col("pages").cast(pl.Int64).alias("page"))


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

