"""The Fleet view's table: every node configuration in the window (pool vs advertised context, F8's
numbers from ``kvtrail.forensics.node_capacity``) beside its producer's cheap aggregates.

Everything here is an aggregate over small tables or one event kind (``node_config``, ``recorder_gap``)
and the batch index, never a page replay, so the view loads in the same time on any store size.
"""

from __future__ import annotations

import duckdb
import polars as pl

from kvtrail import forensics as fx

_PRODUCERS_SQL = """
WITH cfg AS (
    SELECT producer_id, checksum_enabled, canary_enabled, deferred_release, page_tags,
           row_number() OVER (PARTITION BY producer_id ORDER BY wall_ns DESC) AS newest
    FROM events_v WHERE kind = 'node_config' AND wall_ns <= ?),
gaps AS (
    SELECT producer_id, sum(dropped_events)::BIGINT AS recorder_dropped_events
    FROM events_v WHERE kind = 'recorder_gap' AND wall_ns BETWEEN ? AND ? GROUP BY producer_id),
last AS (SELECT producer_id, max(max_wall_ns) AS last_event_ns FROM batches GROUP BY producer_id)
SELECT p.node, p.instance, p.engine, p.engine_version, last.last_event_ns,
       cfg.checksum_enabled, cfg.canary_enabled, cfg.deferred_release, cfg.page_tags,
       coalesce(gaps.recorder_dropped_events, 0) AS recorder_dropped_events
FROM producers p
LEFT JOIN cfg ON cfg.producer_id = p.producer_id AND cfg.newest = 1
LEFT JOIN gaps ON gaps.producer_id = p.producer_id
LEFT JOIN last ON last.producer_id = p.producer_id"""

_MIN_NS, _MAX_NS = 0, 2**63 - 1
COLUMNS = ("node", "role", "pool_tokens", "context_tokens", "shortfall_tokens", "pool_covers_context",
           "page_size", "pool_pages", "checksum_enabled", "canary_enabled", "deferred_release", "page_tags",
           "engine", "engine_version", "instance", "effective_from_ns", "last_event_ns",
           "recorder_dropped_events", "unexplained_gap_events")


def fleet_table(con: duckdb.DuckDBPyConnection, w: fx.Window) -> pl.DataFrame:
    """One row per node configuration in effect during the window, nodes below their context first."""
    fx.check_window(con, fx.Window(w.from_ns, w.to_ns, node=w.node))
    lo = _MIN_NS if w.from_ns is None else w.from_ns
    hi = _MAX_NS if w.to_ns is None else w.to_ns
    capacity = fx.node_capacity(con, w.from_ns, w.to_ns)
    if w.node:
        capacity = capacity.filter(pl.col("node") == w.node)
    producers = pl.DataFrame(con.sql(_PRODUCERS_SQL, params=[hi, lo, hi]).to_arrow_table())
    gaps = fx.coverage_gaps(con).select("node", "instance", pl.col("unexplained").alias("unexplained_gap_events"))
    table = (capacity.join(producers, on=["node", "instance"], how="left")
             .join(gaps, on=["node", "instance"], how="left")
             .with_columns(pl.col("unexplained_gap_events").fill_null(0)))
    return table.select(COLUMNS).sort(["pool_covers_context", "node", "effective_from_ns"])
