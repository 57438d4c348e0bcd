"""Per-(producer, minute) aggregates of the store, and per-(node, minute) findings counts: what dashboards read
instead of scanning events.

Three derived tables beside the events, like ``findings`` and ``forensic_runs``: not part of the hash
chain, rebuilt idempotently. ``minute_events`` holds, per producer (so per node and instance) and UTC
minute, the events and page-events, reads, writes, transfers, aborts, responses by HTTP status class,
recorder gaps and drops and the last event time; ``minute_findings`` the persisted findings per node,
minute (of their ``last_ns``), code and severity; ``minute_coverage`` for each minute the store state its
events were counted at (``as_of_ns``: the newest batch change, commit or prune, they include).

A minute is *covered* when no batch overlapping it changed after its ``as_of_ns``: its events rows are
then exactly what a scan of the ``events`` view would count. Two writers keep them: :func:`recompute`
(SQL over ``events`` for a window's minutes; ``forensics findings --save`` runs it through
:func:`~kvtrail.forensics.results.persist.save_findings`) and :func:`add_batches` (committed Arrow batches, as
:class:`~kvtrail.audit.store.AppendResult` hands them to the live judge). Findings counts are rebuilt
from the ``findings`` table for every minute a save touches. Readers ask
:func:`kvtrail.forensics.results.window_counts.window_counts`.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import numpy as np
import pyarrow as pa

from kvtrail.audit.arrowutil import list_lengths

MINUTE_NS = 60 * 10**9
MIN_NS, MAX_NS = 0, 2**63 - 1
# (column, SQL over an event relation with kind, wall_ns, http_status, status, dropped_events and PE: its
# page-events). Sums, except last_event_ns (a max).
COUNTERS: tuple[tuple[str, str], ...] = (
    ("events", "count(*)"),
    ("page_events", "sum(PE)"),
    ("allocations", "count(*) FILTER (kind = 'pages_allocated')"),
    ("frees", "count(*) FILTER (kind = 'pages_freed')"),
    ("reads", "count(*) FILTER (kind = 'kv_read')"),
    ("read_page_events", "coalesce(sum(PE) FILTER (kind = 'kv_read'), 0)"),
    ("writes", "count(*) FILTER (kind = 'kv_written')"),
    ("write_page_events", "coalesce(sum(PE) FILTER (kind = 'kv_written'), 0)"),
    ("transfers_reserved", "count(*) FILTER (kind = 'transfer_reserved')"),
    ("transfers_sent", "count(*) FILTER (kind = 'transfer_sent')"),
    ("transfers_received", "count(*) FILTER (kind = 'transfer_received')"),
    ("transfers_not_ok", "count(*) FILTER (kind = 'transfer_received' AND status <> 'ok')"),
    ("aborts", "count(*) FILTER (kind = 'request_aborted')"),
    ("responses_2xx", "count(*) FILTER (kind = 'response_sent' AND http_status BETWEEN 200 AND 299)"),
    ("responses_4xx", "count(*) FILTER (kind = 'response_sent' AND http_status BETWEEN 400 AND 499)"),
    ("responses_5xx", "count(*) FILTER (kind = 'response_sent' AND http_status BETWEEN 500 AND 599)"),
    (
        "responses_other",
        "count(*) FILTER (kind = 'response_sent' AND NOT http_status BETWEEN 200 AND 299 "
        "AND NOT http_status BETWEEN 400 AND 599)",
    ),
    ("recorder_gaps", "count(*) FILTER (kind = 'recorder_gap')"),
    ("recorder_dropped_events", "coalesce(sum(dropped_events) FILTER (kind = 'recorder_gap'), 0)"),
    ("last_event_ns", "max(wall_ns)"),
)
COUNTER_NAMES = tuple(c for c, _ in COUNTERS)
_SUMS = tuple(c for c in COUNTER_NAMES if c != "last_event_ns")
_IDENTITY = ("cluster", "node", "role", "engine", "engine_version", "instance")
_DDL = (
    "CREATE TABLE IF NOT EXISTS minute_events (producer_id BIGINT NOT NULL, minute_ns BIGINT NOT NULL, "
    + ", ".join(f"{c} BIGINT NOT NULL" for c in COUNTER_NAMES)
    + ", PRIMARY KEY (producer_id, minute_ns))",
    "CREATE TABLE IF NOT EXISTS minute_findings (node VARCHAR, minute_ns BIGINT NOT NULL, code VARCHAR NOT NULL, "
    "severity VARCHAR NOT NULL, findings BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS minute_coverage (minute_ns BIGINT PRIMARY KEY, as_of_ns BIGINT NOT NULL)",
)
TABLES = ("minute_events", "minute_findings", "minute_coverage")
# When each batch last changed: its commit, or the prune that removed its events.
CHANGED_SQL = """(SELECT b.producer_id, b.batch_no, b.min_wall_ns, b.max_wall_ns,
                      greatest(b.committed_ns, coalesce(p.wall_ns, 0)) AS changed_ns
               FROM batches b LEFT JOIN prunes p ON p.prune_id = b.pruned_by)"""


def ensure_tables(con: duckdb.DuckDBPyConnection) -> None:
    for ddl in _DDL:
        con.execute(ddl)


def has_tables(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the store holds the aggregate tables (a read-only reader cannot create them)."""
    row = con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name IN "
        "('minute_events', 'minute_findings', 'minute_coverage')"
    ).fetchall()[0]
    return row[0] == len(TABLES)


def counters_sql(source: str, page_events: str, where: str, by: str) -> str:
    """The :data:`COUNTERS` of relation ``source`` (``page_events``: its page-events expression) grouped ``by``."""
    cols = ", ".join(f"{expr.replace('PE', page_events)}::BIGINT AS {name}" for name, expr in COUNTERS)
    return f"SELECT {by}, {cols} FROM {source} WHERE {where} GROUP BY ALL"


_MINUTE = f"(wall_ns // {MINUTE_NS}) * {MINUTE_NS}"
STORED_PE = "(num_pages + num_dst_pages)"  # a stored event's page-events (both run-encoded lists)


def recompute(con: duckdb.DuckDBPyConnection, from_ns: int | None, to_ns: int | None) -> int:
    """Rebuild every minute overlapping [from_ns, to_ns] (the store's span when unbounded) from the events and
    the ``findings`` table, in one transaction; returns how many minutes are now covered."""
    ensure_tables(con)
    con.begin()
    try:
        n = recompute_in(con, from_ns, to_ns)
        con.commit()
    except BaseException:
        con.rollback()
        raise
    return n


def recompute_in(con: duckdb.DuckDBPyConnection, from_ns: int | None, to_ns: int | None) -> int:
    """:func:`recompute` inside the caller's transaction (``save_findings`` keeps its run and these together)."""
    ensure_tables(con)
    span = con.execute(f"SELECT min(min_wall_ns), max(max_wall_ns), max(changed_ns) FROM {CHANGED_SQL}").fetchall()[0]
    if span[0] is None:
        return 0
    lo = max(MIN_NS if from_ns is None else from_ns, span[0]) // MINUTE_NS * MINUTE_NS
    hi = min(MAX_NS if to_ns is None else to_ns, span[1]) // MINUTE_NS * MINUTE_NS
    if lo > hi:
        return 0
    end = hi + MINUTE_NS
    for table in TABLES:
        con.execute(f"DELETE FROM {table} WHERE minute_ns BETWEEN ? AND ?", [lo, hi])
    con.execute(
        "INSERT INTO minute_events "
        + counters_sql("events", STORED_PE, "wall_ns >= ? AND wall_ns < ?", f"producer_id, {_MINUTE} AS minute_ns"),
        [lo, end],
    )
    _findings_for(con, f"SELECT range AS minute_ns FROM range({lo}, {end}, {MINUTE_NS})")
    con.execute("INSERT INTO minute_coverage SELECT range, ? FROM range(?, ?, ?)", [span[2], lo, end, MINUTE_NS])
    return (end - lo) // MINUTE_NS


def _findings_for(con: duckdb.DuckDBPyConnection, minutes_sql: str) -> None:
    """Rebuild the findings counts of the minutes ``minutes_sql`` lists, from the ``findings`` table."""
    if not con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'findings'").fetchall()[0][0]:
        return
    con.execute(f"CREATE OR REPLACE TEMP TABLE _agg_minutes AS {minutes_sql}")
    con.execute("DELETE FROM minute_findings WHERE minute_ns IN (SELECT minute_ns FROM _agg_minutes)")
    con.execute(f"""INSERT INTO minute_findings
        SELECT node, (last_ns // {MINUTE_NS}) * {MINUTE_NS} AS minute_ns, code, severity, count(*) FROM findings
        WHERE (last_ns // {MINUTE_NS}) * {MINUTE_NS} IN (SELECT minute_ns FROM _agg_minutes) GROUP BY ALL""")
    con.execute("DROP TABLE _agg_minutes")


def findings_saved(con: duckdb.DuckDBPyConnection, registered: str) -> None:
    """Rebuild the findings counts of the minutes the findings in relation ``registered`` (a ``last_ns``
    column) end in: called by ``save_findings`` inside its transaction, whatever else it maintains."""
    ensure_tables(con)
    _findings_for(con, f"SELECT DISTINCT (last_ns // {MINUTE_NS}) * {MINUTE_NS} AS minute_ns FROM {registered}")


def _page_events(t: pa.Table) -> pa.Array:
    """Each event's page-events: the lengths of its page lists (absent or null lists count 0)."""
    total = np.zeros(t.num_rows, np.int64)
    for name in ("pages", "dst_pages"):
        if name in t.column_names:
            total += list_lengths(t.column(name))
    return pa.array(total)


def add_batch(con: duckdb.DuckDBPyConnection, table: pa.Table, batches: dict[int, int] | tuple) -> None:
    """Add one committed batch (``AppendResult.table``; ``batches``: its ``{producer_id: batch_no}`` or
    ``AppendResult.batches``) to the aggregates, in one transaction: :func:`add_batches` of one commit."""
    add_batches(con, [(table, batches)])


def add_batches(con: duckdb.DuckDBPyConnection, commits: Sequence[tuple[pa.Table, dict[int, int] | tuple]]) -> None:
    """Add committed batches to the aggregates in one transaction: ``commits`` are (events, batches) pairs, each
    as one ``AppendResult`` hands them (``table``; ``{producer_id: batch_no}`` or ``batches``), one batch per
    producer in a commit, several commits of a producer in one call (a live judge adds what one poll fed).
    A minute they touch stays covered (or becomes covered, when no other batch overlaps it) only if every other
    batch overlapping it was already counted; otherwise its counts grow but readers scan its events until a
    recompute.

    Coverage "as of" a time means every batch changed by then is counted, so a batch committed after these
    does not keep the minute uncovered (readers see it as newer than the coverage until it is added): a judge
    adding batches in commit order keeps the minutes covered while ingest goes on. Adding commits together
    leaves the tables as adding them one after another would."""
    ensure_tables(con)
    pairs = [
        (k, int(pid), int(no))
        for k, (table, batches) in enumerate(commits)
        if table.num_rows
        for pid, no in sorted(batches.items() if isinstance(batches, dict) else batches)
    ]
    if not pairs:
        return
    cols = [
        c
        for c in (*_IDENTITY, "kind", "wall_ns", "http_status", "status", "dropped_events")
        if c in commits[0][0].column_names
    ]
    # Page-events counted here: DuckDB would read every page id of the lists to take their lengths.
    tables = [
        t.select(cols)
        .append_column("pe", _page_events(t))
        .append_column("commit_no", pa.array(np.full(t.num_rows, k, np.int64)))
        for k, (t, _) in enumerate(commits)
        if t.num_rows
    ]
    events = pa.concat_tables(tables, promote_options="permissive")
    con.begin()
    try:
        con.register(
            "_agg_pairs_in",
            pa.table(
                {
                    "commit_no": [p[0] for p in pairs],
                    "producer_id": [p[1] for p in pairs],
                    "batch_no": [p[2] for p in pairs],
                }
            ),
        )
        con.execute(
            f"CREATE OR REPLACE TEMP TABLE _agg_batch AS SELECT i.commit_no, c.producer_id, c.batch_no, "
            f"c.changed_ns FROM {CHANGED_SQL} c JOIN _agg_pairs_in i USING (producer_id, batch_no)"
        )
        con.unregister("_agg_pairs_in")
        con.register("_agg_events", events)
        ident = " AND ".join(f"p.{c} = e.{c}" for c in _IDENTITY)
        source = (
            f"(SELECT p.producer_id, e.commit_no, e.kind::VARCHAR AS kind, e.wall_ns, e.http_status, "
            f"e.status::VARCHAR AS status, e.dropped_events, e.pe "
            f"FROM _agg_events e JOIN producers p ON {ident})"
        )
        # Per commit first: a minute whose coverage is as of a batch's commit or later already counts that
        # batch (a recompute ran since), and adding it again would count it twice. Then one row per minute.
        per_commit = counters_sql(source, "pe", "TRUE", f"producer_id, commit_no, {_MINUTE} AS minute_ns")
        totals = ", ".join(f"max({c})" if c == "last_event_ns" else f"sum({c})::BIGINT" for c in COUNTER_NAMES)
        sets = ", ".join(f"{c} = minute_events.{c} + excluded.{c}" for c in _SUMS)
        con.execute(
            f"INSERT INTO minute_events SELECT g.producer_id, g.minute_ns, {totals} FROM ({per_commit}) g "
            "JOIN _agg_batch b USING (producer_id, commit_no) LEFT JOIN minute_coverage cov USING (minute_ns) "
            "WHERE cov.as_of_ns IS NULL OR cov.as_of_ns < b.changed_ns GROUP BY g.producer_id, g.minute_ns "
            f"ON CONFLICT (producer_id, minute_ns) DO UPDATE SET {sets}, "
            "last_event_ns = greatest(minute_events.last_event_ns, excluded.last_event_ns)"
        )
        con.unregister("_agg_events")
        # Minutes these batches span, each as of the newest of them touching it: covered afterwards when
        # nothing else overlapping it and changed by then is uncounted.
        con.execute(f"""
            INSERT INTO minute_coverage
            WITH mine AS (SELECT c.* FROM {CHANGED_SQL} c JOIN _agg_batch USING (producer_id, batch_no)),
                 minutes AS (SELECT m.range AS minute_ns, max(mine.changed_ns) AS as_of FROM mine,
                             range(mine.min_wall_ns // {MINUTE_NS} * {MINUTE_NS}, mine.max_wall_ns + 1, {MINUTE_NS}) m
                             GROUP BY 1),
                 other AS (SELECT minutes.minute_ns, max(c.changed_ns) AS changed_ns FROM minutes
                           JOIN {CHANGED_SQL} c ON c.max_wall_ns >= minutes.minute_ns
                                AND c.min_wall_ns < minutes.minute_ns + {MINUTE_NS}
                                AND c.changed_ns <= minutes.as_of
                           ANTI JOIN _agg_batch b ON b.producer_id = c.producer_id AND b.batch_no = c.batch_no
                           GROUP BY ALL)
            SELECT minutes.minute_ns, greatest(coalesce(cov.as_of_ns, 0), minutes.as_of)
            FROM minutes LEFT JOIN other USING (minute_ns) LEFT JOIN minute_coverage cov USING (minute_ns)
            WHERE coalesce(other.changed_ns, -1) <= coalesce(cov.as_of_ns, -1)
            ON CONFLICT (minute_ns) DO UPDATE SET as_of_ns = excluded.as_of_ns""")
        con.execute("DROP TABLE _agg_batch")
        con.commit()
    except BaseException:
        con.rollback()
        raise


def uncovered_minutes(con: duckdb.DuckDBPyConnection, lo: int, hi: int) -> list[int]:
    """The minutes in [lo, hi] (minute starts) some batch touches whose aggregates are not exact (never
    counted, or a batch overlapping them changed since). A minute no batch touches holds no events."""
    have = has_tables(con)
    cov = (
        "LEFT JOIN minute_coverage cov USING (minute_ns)"
        if have
        else "LEFT JOIN (SELECT NULL::BIGINT AS minute_ns, NULL::BIGINT AS as_of_ns) cov USING (minute_ns)"
    )
    rows = con.execute(
        f"""
        WITH touched AS (SELECT m.range AS minute_ns, max(c.changed_ns) AS changed_ns FROM {CHANGED_SQL} c,
                         range(c.min_wall_ns // {MINUTE_NS} * {MINUTE_NS}, c.max_wall_ns + 1, {MINUTE_NS}) m
                         WHERE c.max_wall_ns >= ? AND c.min_wall_ns < ? AND m.range BETWEEN ? AND ? GROUP BY ALL)
        SELECT t.minute_ns FROM touched t {cov}
        WHERE cov.as_of_ns IS NULL OR cov.as_of_ns < t.changed_ns ORDER BY 1""",
        [lo, hi + MINUTE_NS, lo, hi],
    ).fetchall()
    return [int(r[0]) for r in rows]


def merge_minutes(minutes: list[int]) -> list[tuple[int, int]]:
    """Sorted minute starts as [start, end) ns spans, neighbours joined."""
    out: list[tuple[int, int]] = []
    for m in minutes:
        if out and out[-1][1] == m:
            out[-1] = (out[-1][0], m + MINUTE_NS)
        else:
            out.append((m, m + MINUTE_NS))
    return out


def refresh(con: duckdb.DuckDBPyConnection) -> int:
    """Recompute every minute that is not covered (batches committed or pruned since they were counted, e.g.
    those a judge read back from the store instead of being handed), in one transaction; how many minutes."""
    ensure_tables(con)
    con.begin()
    try:
        spans = merge_minutes(uncovered_minutes(con, MIN_NS, MAX_NS - MINUTE_NS))
        n = sum(recompute_in(con, a, b - 1) for a, b in spans)
        con.commit()
    except BaseException:
        con.rollback()
        raise
    return n
