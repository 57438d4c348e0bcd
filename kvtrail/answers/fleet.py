"""The Fleet view's table: every node configuration in the window (pool vs advertised context, F8's
numbers from ``kvtrail.forensics.node_capacity``) beside its producer's cheap aggregates.

Everything here is an aggregate over small tables or one event kind (``node_config``), the batch index
(last event seen, sequence gaps) and the window's per-minute counters (recorder drops: from
``kvtrail.forensics.results.aggregates`` where they cover the window, from the events elsewhere), never a page
replay, so the view loads in the same time on any store size.
"""

from __future__ import annotations

import duckdb
import polars as pl

from kvtrail import forensics as fx
from kvtrail.audit.configs import latest_configs
from kvtrail.forensics.analysis import node_capacity
from kvtrail.forensics.results.window_counts import WindowCounts

_PRODUCERS_SQL = """
WITH last AS (SELECT producer_id, max(max_wall_ns) AS last_event_ns FROM batches GROUP BY producer_id)
SELECT p.producer_id, p.node, p.instance, p.engine, p.engine_version, last.last_event_ns
FROM producers p
LEFT JOIN last ON last.producer_id = p.producer_id"""
_INTEGRITY = ("checksum_enabled", "canary_enabled", "deferred_release", "page_tags")

_MAX_NS = 2**63 - 1
COLUMNS = (
    "node",
    "role",
    "pool_tokens",
    "context_tokens",
    "shortfall_tokens",
    "pool_covers_context",
    "page_size",
    "pool_pages",
    "checksum_enabled",
    "canary_enabled",
    "deferred_release",
    "page_tags",
    "engine",
    "engine_version",
    "instance",
    "effective_from_ns",
    "last_event_ns",
    "recorder_dropped_events",
    "unexplained_gap_events",
)


def fleet_table(con: duckdb.DuckDBPyConnection, w: fx.Window, counts: WindowCounts) -> pl.DataFrame:
    """One row per node configuration in effect during the window, nodes below their context first
    (``counts``: the window's counters, :func:`kvtrail.forensics.results.aggregates.window_counts`)."""
    fx.check_window(con, fx.Window(w.from_ns, w.to_ns, node=w.node))
    hi = _MAX_NS if w.to_ns is None else w.to_ns
    capacity = node_capacity(con, w.from_ns, w.to_ns)
    if w.node:
        capacity = capacity.filter(pl.col("node") == w.node)
    drops = counts.events.select("producer_id", "recorder_dropped_events")
    integrity = pl.DataFrame(latest_configs(con, ("producer_id", *_INTEGRITY), at_ns=hi))
    producers = (
        pl.DataFrame(con.sql(_PRODUCERS_SQL).to_arrow_table())
        .join(integrity, on="producer_id", how="left")
        .join(drops, on="producer_id", how="left")
        .with_columns(pl.col("recorder_dropped_events").fill_null(0))
        .drop("producer_id")
    )
    gaps = fx.coverage_gaps(con).select("node", "instance", pl.col("unexplained").alias("unexplained_gap_events"))
    table = (
        capacity.join(producers, on=["node", "instance"], how="left")
        .join(gaps, on=["node", "instance"], how="left")
        .with_columns(pl.col("unexplained_gap_events").fill_null(0))
    )
    return table.select(COLUMNS).sort(["pool_covers_context", "node", "effective_from_ns"])
