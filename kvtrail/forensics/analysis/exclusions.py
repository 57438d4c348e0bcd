"""Exclusions: accounts and requests (internal tests, a researcher's reproduction) left out of every count.

They remove *recipients* from every count: their reads are not exposure of customer data to another
customer. Data of an excluded account read by someone else still counts as exposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb
import polars as pl

from kvtrail.audit.store import arrow_query
from kvtrail.errors import KvtrailError


@dataclass(frozen=True)
class Exclusions:
    """Accounts and requests left out of every count, each ``(id, reason)``."""

    tenants: tuple[tuple[str, str], ...] = ()
    api_key_ids: tuple[tuple[str, str], ...] = ()
    request_ids: tuple[tuple[str, str], ...] = ()
    # where each excluded tenant was named (e.g. "incident.yaml: exclusions.tenants[0]"), for the errors;
    # not part of what is excluded
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)

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

        return Exclusions(
            merge(self.tenants, other.tenants),
            merge(self.api_key_ids, other.api_key_ids),
            merge(self.request_ids, other.request_ids),
            merge(self.sources, other.sources),
        )

    def to_dict(self) -> dict:
        return {
            name: [{"id": k, "reason": v} for k, v in sorted(getattr(self, name))]
            for name in ("tenants", "api_key_ids", "request_ids")
        }

    @classmethod
    def from_dict(cls, data: dict) -> Exclusions:
        """Inverse of :meth:`to_dict` (for manifests kvtrail wrote itself)."""
        return cls(
            *(
                tuple((e["id"], e["reason"]) for e in data.get(name, ()))
                for name in ("tenants", "api_key_ids", "request_ids")
            )
        )


def check_exclusions(con: duckdb.DuckDBPyConnection, excl: Exclusions) -> None:
    """Refuse an excluded tenant the store has never seen (most likely a typo), naming where it was listed."""
    if not excl.tenants:
        return
    rows = con.execute("SELECT DISTINCT tenant_id FROM events_v WHERE tenant_id IS NOT NULL").fetchall()
    known = {r[0] for r in rows}
    where = dict(excl.sources)
    for tenant, _ in excl.tenants:
        if tenant not in known:
            raise KvtrailError(
                f"{where.get(tenant, 'exclusions')}: unknown tenant {tenant!r} (not in the store); "
                f"known: {', '.join(sorted(known)[:20])}"
            )


def excluded_requests(con: duckdb.DuckDBPyConnection, excl: Exclusions) -> pl.DataFrame:
    """Every request the exclusions cover: request_id, tenant_id, excluded_by, reason (one row each)."""
    schema = {"request_id": pl.Utf8, "tenant_id": pl.Utf8, "excluded_by": pl.Utf8, "reason": pl.Utf8}
    if excl.empty:
        return pl.DataFrame(schema=schema)
    ids = arrow_query(
        con,
        "SELECT DISTINCT request_id, tenant_id, api_key_id FROM events_v "
        "WHERE request_id IS NOT NULL AND (list_contains(?::VARCHAR[], tenant_id) "
        "OR list_contains(?::VARCHAR[], api_key_id) OR list_contains(?::VARCHAR[], request_id))",
        [[t for t, _ in excl.tenants], [k for k, _ in excl.api_key_ids], [r for r, _ in excl.request_ids]],
    ).to_pylist()
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


def excluded_mask(excluded: pl.DataFrame, excl: Exclusions) -> pl.Expr:
    """Rows (with request_id and tenant_id) of an excluded request or tenant; ``excluded``: from
    :func:`excluded_requests`."""
    return (
        pl.col("request_id").is_in(excluded["request_id"].to_list())
        | pl.col("tenant_id").is_in([t for t, _ in excl.tenants])
    ).fill_null(False)


def split_excluded(
    df: pl.DataFrame, excluded: pl.DataFrame, excl: Exclusions, tenant_col: str = "tenant_id"
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(kept rows, excluded rows with ``excluded_by`` and ``reason``) of a frame with request_id/tenant."""
    tenants = dict(excl.tenants)
    marks = df.select("request_id", tenant_col).join(
        excluded.select("request_id", "excluded_by", "reason"), on="request_id", how="left"
    )
    marks = marks.with_columns(
        pl.when(pl.col("excluded_by").is_null() & pl.col(tenant_col).is_in(list(tenants)))
        .then(pl.lit("tenant ") + pl.col(tenant_col))
        .otherwise(pl.col("excluded_by"))
        .alias("excluded_by"),
        pl.when(pl.col("reason").is_null() & pl.col(tenant_col).is_in(list(tenants)))
        .then(pl.col(tenant_col).replace_strict(tenants, default=None))
        .otherwise(pl.col("reason"))
        .alias("reason"),
    )
    hit = marks["excluded_by"].is_not_null()
    dropped = df.filter(hit).with_columns(marks.filter(hit).select("excluded_by", "reason"))
    return df.filter(~hit), dropped
