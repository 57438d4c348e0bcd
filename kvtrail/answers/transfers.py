"""The Transfers view's rows: length (F2) and digest (F3) mismatches with the node pair they crossed.

A mismatch finding names the node where it was seen; the other end of the pair is whichever node sent
the request's KV (its ``transfer_sent`` events), looked up for the mismatching requests only.
"""

from __future__ import annotations

import duckdb
import polars as pl

from kvtrail import forensics as fx
from kvtrail.answers.spec import TRANSFERS
from kvtrail.forensics.questions import findings_frame

CODES = ("F2", "F3")
SCHEMA = TRANSFERS.schema


def mismatches(con: duckdb.DuckDBPyConnection, found: list[fx.Finding], w: fx.Window) -> pl.DataFrame:
    """One row per F2/F3 finding in the window (tenant and node filters applied), oldest first."""
    frame = findings_frame(found, w, CODES)
    if frame.is_empty():
        return pl.DataFrame(schema=SCHEMA)
    ids = frame["request_id"].drop_nulls().unique().to_list()
    ends = pl.DataFrame(
        con.sql(
            "SELECT request_id, min(node) FILTER (role = 'prefill') AS prefill_node, "
            "min(node) FILTER (role = 'decode') AS decode_node FROM events_v "
            "WHERE kind IN ('transfer_sent', 'transfer_reserved', 'transfer_received') "
            "AND list_contains(?::VARCHAR[], request_id) GROUP BY request_id",
            params=[ids],
        ).to_arrow_table()
    )
    if ends.is_empty():
        ends = pl.DataFrame(schema={"request_id": pl.Utf8, "prefill_node": pl.Utf8, "decode_node": pl.Utf8})
    out = (
        frame.join(ends, on="request_id", how="left")
        .with_columns(
            pl.col("decode_node").fill_null(pl.col("node")),
        )
        .with_columns(pl.format("{} -> {}", pl.col("prefill_node").fill_null("?"), pl.col("decode_node")).alias("pair"))
    )
    return out.select(list(SCHEMA)).cast(SCHEMA).sort("last_ns")  # type: ignore[arg-type]
