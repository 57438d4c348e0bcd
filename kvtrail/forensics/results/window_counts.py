"""A window's counters from the per-minute aggregates (:mod:`kvtrail.forensics.results.aggregates`) where they are
exact, and from the events elsewhere.

:func:`window_counts` splits [from, to] into the whole minutes the aggregates cover (read from
``minute_events`` and ``minute_findings``) and the rest: the window's partial first and last minutes,
and every minute a batch changed after it was counted (a commit no one added, a prune), read by SQL over
the ``events`` view. The sum equals a scan of the whole window whatever the aggregates hold, so a
reader never has to know whether they were built.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import polars as pl

from kvtrail.forensics.results.aggregates import (
    COUNTER_NAMES,
    MAX_NS,
    MIN_NS,
    MINUTE_NS,
    STORED_PE,
    counters_sql,
    has_tables,
    merge_minutes,
    uncovered_minutes,
)


@dataclass(frozen=True)
class WindowCounts:
    """A window's counters per producer (``events``: producer_id, node, instance and :data:`COUNTER_NAMES`)
    and the persisted findings counts of the minutes the aggregates answered (``findings``: node, minute_ns,
    code, severity, findings). ``answered``/``scanned``: the [start, end) ns spans read from the
    aggregates and from the events."""

    events: pl.DataFrame
    findings: pl.DataFrame
    answered: tuple[tuple[int, int], ...]
    scanned: tuple[tuple[int, int], ...]
    minutes: int  # whole minutes in the window
    answered_minutes: int  # of those, answered by the aggregates

    def describe(self) -> str:
        """One line for a view's caption: how much the aggregates answered."""
        if not self.minutes:
            return "aggregates: the window holds no whole minute; read from the events"
        if not self.answered_minutes:
            return f"aggregates cover none of the window's {self.minutes} whole minutes: read from the events"
        rest = "the rest read from the events" if self.scanned else "nothing read from the events"
        return f"aggregates cover {self.answered_minutes} of the window's {self.minutes} whole minutes; {rest}"


def _spans_sql(column: str, spans: tuple[tuple[int, int], ...]) -> tuple[str, list[int]]:
    if not spans:
        return "FALSE", []
    return "(" + " OR ".join(f"({column} >= ? AND {column} < ?)" for _ in spans) + ")", [x for s in spans for x in s]


def window_counts(con: duckdb.DuckDBPyConnection, from_ns: int | None, to_ns: int | None) -> WindowCounts:
    """The counters of [from_ns, to_ns] (ns, inclusive) per producer: whole covered minutes from the
    aggregates, the rest by SQL over the events; equal to a scan of the window either way."""
    span = con.execute("SELECT min(min_wall_ns), max(max_wall_ns) FROM batches").fetchall()[0]
    lo = MIN_NS if from_ns is None else from_ns
    end = (MAX_NS if to_ns is None else to_ns) + 1
    if span[0] is not None:  # clamp to the store's span: no events lie outside it
        lo, end = max(lo, span[0]), min(end, span[1] + 1)
    first = -(-lo // MINUTE_NS) * MINUTE_NS
    stop = end // MINUTE_NS * MINUTE_NS
    answered: list[tuple[int, int]] = []
    scanned: list[tuple[int, int]] = []
    minutes = max(0, (stop - first) // MINUTE_NS)
    if span[0] is None or minutes == 0:
        if span[0] is not None and lo < end:
            scanned.append((lo, end))
    else:
        holes = uncovered_minutes(con, first, stop - MINUTE_NS) if has_tables(con) else None
        if holes is None:  # no aggregates in this store: the whole window is scanned
            scanned.append((lo, end))
        else:
            at = first
            for a, b in merge_minutes(holes):
                if at < a:
                    answered.append((at, a))
                at = b
            if at < stop:
                answered.append((at, stop))
            edges = ([(lo, first)] if lo < first else []), ([(stop, end)] if stop < end else [])
            scanned = edges[0] + merge_minutes(holes) + edges[1]
    ans, scn = tuple(answered), tuple(scanned)
    answered_minutes = sum((b - a) // MINUTE_NS for a, b in ans)
    return WindowCounts(_event_counts(con, ans, scn), _finding_counts(con, ans), ans, scn, minutes, answered_minutes)


def _event_counts(con: duckdb.DuckDBPyConnection, answered: tuple, scanned: tuple) -> pl.DataFrame:
    parts, params = [], []
    if answered:
        where, p = _spans_sql("minute_ns", answered)
        parts.append(f"SELECT producer_id, {', '.join(COUNTER_NAMES)} FROM minute_events WHERE {where}")
        params += p
    if scanned:
        where, p = _spans_sql("wall_ns", scanned)
        parts.append(counters_sql("events", STORED_PE, where, "producer_id"))
        params += p
    if not parts:
        parts.append(
            f"SELECT NULL::BIGINT AS producer_id, {', '.join(f'0::BIGINT AS {c}' for c in COUNTER_NAMES)} WHERE FALSE"
        )
    agg = ", ".join(
        f"max({c})::BIGINT AS {c}" if c == "last_event_ns" else f"sum({c})::BIGINT AS {c}" for c in COUNTER_NAMES
    )
    sql = (
        f"SELECT x.producer_id, p.node, p.instance, {agg} FROM ({' UNION ALL '.join(parts)}) x "
        "JOIN producers p USING (producer_id) GROUP BY ALL ORDER BY x.producer_id"
    )
    return pl.DataFrame(con.sql(sql, params=params).to_arrow_table())


_FINDINGS_SCHEMA = {"node": pl.Utf8, "minute_ns": pl.Int64, "code": pl.Utf8, "severity": pl.Utf8, "findings": pl.Int64}


def _finding_counts(con: duckdb.DuckDBPyConnection, answered: tuple) -> pl.DataFrame:
    if not answered:
        return pl.DataFrame(schema=_FINDINGS_SCHEMA)
    where, params = _spans_sql("minute_ns", answered)
    rows = con.sql(
        f"SELECT node, minute_ns, code, severity, sum(findings)::BIGINT AS findings FROM minute_findings "
        f"WHERE {where} GROUP BY ALL ORDER BY minute_ns, code",
        params=params,
    ).to_arrow_table()
    return pl.DataFrame(rows).cast(_FINDINGS_SCHEMA)  # type: ignore[arg-type]
