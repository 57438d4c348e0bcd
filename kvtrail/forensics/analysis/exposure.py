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
    f = found.filter(
        pl.col("code").is_in(sorted(AFFECTED_CODES))
        & pl.col("request_id").is_in(sorted(request_ids))
        & (pl.col("victim_request_ids").list.len() > 0)
        & (pl.col("pages").list.len() > 0)
    )
    v = (
        f.select("request_id", "tenant_id", "node", "pages", "victim_request_ids", "victim_tenant_ids")
        .explode(["victim_request_ids", "victim_tenant_ids"])
        .explode("pages")
    )
    recipient = pl.when(pl.col("tenant_id").is_null() | (pl.col("tenant_id") == "")).then(pl.lit(UNKNOWN_TENANT))
    victim = (
        pl.when(pl.col("victim_tenant_ids").is_not_null())
        .then(pl.col("victim_tenant_ids"))
        .when(pl.col("victim_request_ids").is_null())
        .then(pl.lit(NEVER_WRITTEN))
        .otherwise(pl.lit(UNKNOWN_TENANT))
    )
    return v.select(
        pl.col("request_id").cast(pl.Utf8),
        recipient.otherwise(pl.col("tenant_id")).cast(pl.Utf8).alias("recipient_tenant"),
        victim.cast(pl.Utf8).alias("victim_tenant"),
        pl.col("victim_request_ids").cast(pl.Utf8).alias("victim_request_id"),
        pl.col("node").cast(pl.Utf8),
        pl.col("pages").cast(pl.Int64).alias("page"),
    )


def _page_key() -> pl.Expr:
    return pl.struct("request_id", "node", "page").n_unique()


def exposure_matrix(links: pl.DataFrame) -> pl.DataFrame:
    """Recipient tenant x victim tenant: responses, pages read, distinct victim requests (long form)."""
    return (
        links.group_by("recipient_tenant", "victim_tenant")
        .agg(
            pl.col("request_id").n_unique().alias("responses"),
            _page_key().alias("pages"),
            pl.col("victim_request_id").drop_nulls().n_unique().alias("victim_requests"),
        )
        .with_columns(pl.col("responses", "pages", "victim_requests").cast(pl.Int64))
        .sort("recipient_tenant", "victim_tenant")
    )


def _other() -> pl.Expr:
    return pl.col("recipient_tenant") != pl.col("victim_tenant")


def same_tenant() -> pl.Expr:
    """A link whose victim is another request of the recipient's own (known) tenant."""
    victim = pl.col("victim_tenant")
    return (pl.col("recipient_tenant") == victim) & ~victim.is_in(list(PSEUDO_VICTIMS))


def exposed_tenants(links: pl.DataFrame) -> pl.DataFrame:
    """Per victim tenant (real tenants only): which other tenants read their data, in how many responses and
    pages, and apart from that how often the tenant's own other requests read it (``same_tenant_*``).

    A tenant is never another customer of itself: ``recipient_tenants``, ``recipient_count``, ``responses``,
    ``pages`` and ``victim_requests`` count reads by other tenants' responses only.
    """
    real = links.filter(~pl.col("victim_tenant").is_in(list(PSEUDO_VICTIMS)))
    other, own = _other(), same_tenant()
    return (
        real.group_by("victim_tenant")
        .agg(
            pl.col("recipient_tenant").filter(other).unique().sort().str.join(",").alias("recipient_tenants"),
            pl.col("recipient_tenant").filter(other).n_unique().alias("recipient_count"),
            pl.col("request_id").filter(other).n_unique().alias("responses"),
            pl.struct("request_id", "node", "page").filter(other).n_unique().alias("pages"),
            pl.col("victim_request_id").filter(other).drop_nulls().n_unique().alias("victim_requests"),
            pl.col("victim_request_id")
            .filter(other)
            .drop_nulls()
            .unique()
            .sort()
            .str.join(",")
            .alias("victim_request_ids"),
            pl.col("request_id").filter(own).n_unique().alias("same_tenant_responses"),
            pl.struct("request_id", "node", "page").filter(own).n_unique().alias("same_tenant_pages"),
            pl.col("victim_request_id").filter(own).drop_nulls().n_unique().alias("same_tenant_victim_requests"),
            pl.col("victim_request_id")
            .filter(own)
            .drop_nulls()
            .unique()
            .sort()
            .str.join(",")
            .alias("same_tenant_victim_request_ids"),
        )
        .with_columns(
            pl.col(
                "recipient_count",
                "responses",
                "pages",
                "victim_requests",
                "same_tenant_responses",
                "same_tenant_pages",
                "same_tenant_victim_requests",
            ).cast(pl.Int64)
        )
        .sort("victim_tenant")
    )


READ_KINDS = ("other_tenants", "same_tenant", "never_written")


def response_reads(links: pl.DataFrame, affected: pl.DataFrame) -> pl.DataFrame:
    """Per affected response (``request_id``, ``tenant_id``), what it read from its tenant's point of view
    (``read``): ``other_tenants`` when some page it read was last written by another tenant's request (or a
    request whose tenant is unknown), else ``same_tenant`` when by another request of its own tenant, else
    ``never_written``: only pages no request wrote since their pool was created (stale or uninitialised
    memory, no customer's data identified), or pages with no other holder or writer."""
    if affected.is_empty():
        return pl.DataFrame(schema={"request_id": pl.Utf8, "tenant_id": pl.Utf8, "read": pl.Utf8})
    kinds = (
        links.with_columns(
            pl.when(pl.col("victim_tenant") == NEVER_WRITTEN)
            .then(pl.lit(2))
            .when(same_tenant())
            .then(pl.lit(1))
            .otherwise(pl.lit(0))
            .alias("rank")
        )
        .group_by("request_id")
        .agg(pl.col("rank").min())
    )
    return (
        affected.select("request_id", "tenant_id")
        .join(kinds, on="request_id", how="left")
        .with_columns(
            pl.col("rank").fill_null(2).replace_strict(dict(enumerate(READ_KINDS)), return_dtype=pl.Utf8).alias("read")
        )
        .select("request_id", "tenant_id", "read")
    )
