"""What a view counts of the window's findings: the aggregates' per-minute counts where they answer it, the
findings rows elsewhere.

With a saved run covering the window, every persisted finding that ends in a minute the aggregates cover
is counted in ``minute_findings`` (``kvtrail.forensics.results.aggregates``); the rest of the window (its partial
edge minutes, minutes a later commit changed) is counted from the rows. With a tenant filter (the counts
are per node), findings replayed for want of a saved run, or a remote source, every count comes from the
rows. Either way the counts equal the rows': the tally is one row per finding, at its minute.
"""

from __future__ import annotations

import polars as pl

from kvtrail import forensics as fx
from kvtrail.answers.store import PERSISTED

SCHEMA = {"last_ns": pl.Int64, "code": pl.Utf8, "title": pl.Utf8, "severity": pl.Utf8, "node": pl.Utf8}
_TITLES = {c.code: c.title for c in fx.CODES.values()}


def findings_tally(src, w: fx.Window, found: pl.DataFrame) -> tuple[pl.DataFrame, str]:
    """One row per finding of the window (``found``: its filtered findings rows) with the columns the
    counts and the chart need, and a line saying where the counts came from."""
    rows = found.select(list(SCHEMA)).cast(SCHEMA)  # type: ignore[arg-type]
    counts = src.counts(w)
    if counts is None or w.tenant is not None or not src.found(w)[1].startswith(PERSISTED) or not counts.answered:
        return rows, "counts from the findings rows"
    agg = counts.findings if w.node is None else counts.findings.filter(pl.col("node") == w.node)
    spread = (
        agg.with_columns(pl.int_ranges(0, pl.col("findings")).alias("_k"))
        .explode("_k")
        .select(
            pl.col("minute_ns").alias("last_ns"),
            "code",
            pl.col("code").replace_strict(_TITLES, default=None, return_dtype=pl.Utf8).alias("title"),
            "severity",
            "node",
        )
        .cast(SCHEMA)
    )
    if counts.scanned:
        rest = rows.filter(
            pl.any_horizontal([(pl.col("last_ns") >= a) & (pl.col("last_ns") < b) for a, b in counts.scanned])
        )
    else:
        rest = rows.clear()
    return pl.concat([spread, rest]), f"counts: {counts.describe()}"
