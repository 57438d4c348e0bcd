"""Pool vs context per node, and the threshold analysis of prompts against their prefill node's pool."""

from __future__ import annotations

import duckdb
import polars as pl

from kvtrail.audit.configs import configs_in_effect
from kvtrail.audit.store import arrow_query

_MIN_NS, _MAX_NS = -(2**63), 2**63 - 1


def node_capacity(con: duckdb.DuckDBPyConnection, from_ns: int | None, to_ns: int | None) -> pl.DataFrame:
    """Pool vs advertised context of every node configuration in effect during the window (F8's numbers)."""
    t = configs_in_effect(
        con,
        (
            "node",
            "role",
            "instance",
            "wall_ns AS effective_from_ns",
            "pool_tokens",
            "context_tokens",
            "page_size",
            "pool_pages",
        ),
        from_ns,
        to_ns,
    )
    df = pl.DataFrame(t)
    return df.with_columns(
        (pl.col("pool_tokens") >= pl.col("context_tokens")).alias("pool_covers_context"),
        pl.max_horizontal(pl.col("context_tokens") - pl.col("pool_tokens"), pl.lit(0)).alias("shortfall_tokens"),
    )


_REQUESTS_SQL = """
WITH rr AS (
    SELECT request_id, transfer_id, tenant_id, api_key_id, prompt_tokens, wall_ns, role, node, instance, producer_id
    FROM events_v WHERE kind = 'request_received' AND request_id IS NOT NULL
      AND ((wall_ns >= ? AND wall_ns < ?) OR list_contains(?::VARCHAR[], request_id))),
cfg AS (SELECT producer_id, wall_ns, pool_tokens FROM events WHERE kind = 'node_config'),
pre AS (SELECT rr.request_id, rr.transfer_id, rr.node, rr.instance, cfg.wall_ns AS config_ns, cfg.pool_tokens
        FROM (SELECT * FROM rr WHERE role = 'prefill') rr
        ASOF LEFT JOIN cfg ON rr.producer_id = cfg.producer_id AND rr.wall_ns >= cfg.wall_ns),
req AS (SELECT request_id, max(tenant_id) AS tenant_id, max(api_key_id) AS api_key_id,
               max(transfer_id) AS transfer_id, max(prompt_tokens) AS prompt_tokens, min(wall_ns) AS received_ns
        FROM rr GROUP BY request_id),
-- one prefill node instance per request (a restarted node is a new instance, with a pool of its own)
by_rid AS (SELECT request_id, arg_min(struct_pack(node, instance, config_ns, pool_tokens), node) AS p
           FROM pre GROUP BY request_id),
by_tid AS (SELECT transfer_id, arg_min(struct_pack(node, instance, config_ns, pool_tokens), node) AS p FROM pre
           WHERE transfer_id IS NOT NULL GROUP BY transfer_id),
resp AS (SELECT request_id, max(http_status) AS http_status FROM events_v
         WHERE kind = 'response_sent' AND request_id IS NOT NULL GROUP BY request_id)
SELECT req.request_id, req.tenant_id, req.api_key_id, req.prompt_tokens, req.received_ns,
       coalesce(a.p, b.p).node AS prefill_node, coalesce(a.p, b.p).instance AS prefill_instance,
       coalesce(a.p, b.p).config_ns AS prefill_config_ns, coalesce(a.p, b.p).pool_tokens AS prefill_pool_tokens,
       resp.http_status
FROM req LEFT JOIN by_rid a USING (request_id)
LEFT JOIN by_tid b ON a.p IS NULL AND b.transfer_id = req.transfer_id
LEFT JOIN resp USING (request_id)
ORDER BY req.received_ns, req.request_id"""


def requests_table(
    con: duckdb.DuckDBPyConnection, from_ns: int | None, to_ns: int | None, also: list[str] | tuple[str, ...] = ()
) -> pl.DataFrame:
    """Requests received in [from_ns, to_ns) (plus the ids in ``also``): tenant, key, prompt tokens, the
    prefill node they went through (its instance, and when the configuration in effect took effect) and its
    pool (tokens) at that moment, and the client's HTTP status."""
    lo, hi = _MIN_NS if from_ns is None else from_ns, _MAX_NS if to_ns is None else to_ns
    return pl.DataFrame(arrow_query(con, _REQUESTS_SQL, [lo, hi, list(also)]))


def threshold_analysis(requests: pl.DataFrame, affected_ids: set[str]) -> tuple[pl.DataFrame, dict]:
    """Affected vs unaffected prompts against the prefill pool of their node.

    ``requests`` comes from :func:`requests_table` with excluded requests already removed. Returns a
    per prefill node configuration (node, instance, effective from, pool) table and a summary dict (see
    :func:`threshold_sentence`): a node that restarted is one node over time, each request counted once,
    with the instance that served it.
    """
    df = requests.with_columns(
        pl.col("request_id").is_in(sorted(affected_ids)).alias("affected"),
        (pl.col("prompt_tokens") > pl.col("prefill_pool_tokens")).alias("over_pool"),
    )
    by_node = (
        df.filter(pl.col("prefill_node").is_not_null())
        .group_by("prefill_node", "prefill_instance", "prefill_config_ns", "prefill_pool_tokens")
        .agg(
            pl.len().alias("requests"),
            pl.col("affected").sum().alias("affected"),
            (pl.col("affected") & pl.col("over_pool")).sum().alias("affected_over_pool"),
            (~pl.col("affected") & pl.col("over_pool")).sum().alias("unaffected_over_pool"),
            pl.col("prompt_tokens").filter(pl.col("affected")).min().alias("min_affected_prompt_tokens"),
            pl.col("prompt_tokens").filter(~pl.col("affected")).max().alias("max_unaffected_prompt_tokens"),
        )
        .with_columns(pl.col("requests", "affected", "affected_over_pool", "unaffected_over_pool").cast(pl.Int64))
        .sort("prefill_node", "prefill_config_ns", "prefill_instance")
    )
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


def thresholds_table(capacity: pl.DataFrame, by_node: pl.DataFrame) -> pl.DataFrame:
    """Each node configuration (:func:`node_capacity`) with the prompts its instance served under it (the
    per-configuration table of :func:`threshold_analysis`): one row per configuration, never a sum over a
    restarted node's instances."""
    keys = {"prefill_node": "node", "prefill_instance": "instance", "prefill_config_ns": "effective_from_ns"}
    return capacity.join(by_node.rename(keys).drop("prefill_pool_tokens"), on=list(keys.values()), how="left")


def _int(v) -> int | None:
    return None if v is None else int(v)


def threshold_sentence(s: dict) -> str:
    """The threshold finding in words, e.g. "every affected prompt (155 of 155) was longer than ..."."""
    if s["affected"] == 0:
        return (
            f"No affected responses; {s['unaffected_over_pool']} of {s['requests']} prompts were longer "
            f"than the prefill pool of their node."
        )
    pools = " / ".join(f"{p:,}" for p in s["affected_pool_tokens"]) or "unknown"
    n, k = s["affected"], s["affected_over_pool"]
    lead = f"Every affected prompt ({k} of {n}) was" if k == n else f"{k} of {n} affected prompts were"
    text = (
        f"{lead} longer than the prefill pool of its node ({pools} tokens); "
        f"{s['unaffected_over_pool']} of {s['unaffected']} unaffected prompts were longer."
    )
    if s["affected_with_pool"] < n:
        text += f" For {n - s['affected_with_pool']} affected responses the prefill node or its pool is unknown."
    return text
