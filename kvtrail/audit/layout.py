"""The event tables: one narrow table per event kind, and the ``events`` view that is their union.

DuckDB's cost of appending a row grows with the table's width, columns left null included: ~1.2 µs a
row into one 48-column table even when 7 columns carry values, ~0.25 µs into 8 columns (measured on a
store file). Most of the 48 belong to one kind or two, so store format 2 keeps each kind's events in
``events_<kind>`` (identity, clocks, the request fields and the payload fields that kind may carry, and
its page-list lengths) and defines ``events`` as a ``UNION ALL`` view with format 1's columns, in its
order and types: every query, :func:`kvtrail.audit.store.read_events` and the chain digest see the same
rows as before. A filter on ``kind`` reaches only that kind's table (each branch's kind is a constant).

Writers go through this module: :func:`append_kinds` (the store's commit), :func:`insert_from` (import
and migration: a wide relation split by kind) and :func:`delete_batches` (retention).
"""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa

from kvtrail.audit.batch import arrow_type
from kvtrail.audit.events import ALL_FIELDS, KIND_NAMES, KINDS, PAGE_LIST_FIELDS, PRODUCER_FIELDS
from kvtrail.errors import StoreError

SQL_TYPES = {"str": "VARCHAR", "enum": "VARCHAR", "int32": "INTEGER", "int64": "BIGINT", "uint64": "UBIGINT",
             "bool": "BOOLEAN", "u64list": "UBIGINT[]", "i64list": "BIGINT[]"}
_PRODUCER_NAMES = tuple(f.name for f in PRODUCER_FIELDS)
# Stored event columns: everything but the producer identity (normalised into producers) and the
# page lists (run-encoded into page_runs), plus the key and the list lengths.
EVENT_VALUE_FIELDS = tuple(f for f in ALL_FIELDS if f.name not in _PRODUCER_NAMES and f.name not in PAGE_LIST_FIELDS)
EVENTS_SCHEMA = pa.schema(
    [pa.field("producer_id", pa.int64()), pa.field("batch_no", pa.int64())]
    + [pa.field(f.name, arrow_type(f.type)) for f in EVENT_VALUE_FIELDS]
    + [pa.field("num_pages", pa.int32()), pa.field("num_dst_pages", pa.int32())]
)
EVENT_COLUMNS = ", ".join(f.name for f in EVENTS_SCHEMA)
_TYPES = {f.name: SQL_TYPES[f.type] for f in EVENT_VALUE_FIELDS}
_TYPES.update(producer_id="BIGINT", batch_no="BIGINT", num_pages="INTEGER", num_dst_pages="INTEGER")
_NOT_NULL = ("producer_id", "batch_no", "schema_version", "seq", "wall_ns", "mono_ns", "num_pages", "num_dst_pages")
# What every kind's table holds besides its own fields (``kind`` itself is the table).
_ENVELOPE = ("schema_version", "seq", "wall_ns", "mono_ns")


def table_name(kind: str) -> str:
    """The table that holds the events of ``kind``."""
    return f"events_{kind}"


KIND_TABLES: tuple[str, ...] = tuple(table_name(k) for k in KIND_NAMES)


def kind_columns(kind: str) -> tuple[str, ...]:
    """The columns of ``kind``'s table, in the view's column order."""
    allowed = KINDS[kind].allowed
    cols = ["producer_id", "batch_no"]
    cols += [f.name for f in EVENT_VALUE_FIELDS if f.name in _ENVELOPE or f.name in allowed]
    cols += [n for n, lst in (("num_pages", "pages"), ("num_dst_pages", "dst_pages")) if lst in allowed]
    return tuple(cols)


_COLUMNS = {k: kind_columns(k) for k in KIND_NAMES}


def column_type(name: str) -> str:
    """The SQL type of an ``events`` column."""
    return _TYPES[name]


def _table_ddl(kind: str) -> str:
    cols = ", ".join(f"{c} {_TYPES[c]}{' NOT NULL' if c in _NOT_NULL else ''}" for c in _COLUMNS[kind])
    return f"CREATE TABLE IF NOT EXISTS {table_name(kind)} ({cols})"


def _branch(kind: str) -> str:
    have = set(_COLUMNS[kind])
    out = []
    for f in EVENTS_SCHEMA:
        if f.name == "kind":
            out.append(f"'{kind}'::VARCHAR AS kind")
        elif f.name in have:
            out.append(f.name)
        elif f.name in ("num_pages", "num_dst_pages"):
            out.append(f"0::INTEGER AS {f.name}")
        else:
            out.append(f"NULL::{_TYPES[f.name]} AS {f.name}")
    return f"SELECT {', '.join(out)} FROM {table_name(kind)}"


def view_ddl() -> str:
    """``events``: every kind's table, with format 1's columns in its order and types."""
    return "CREATE OR REPLACE VIEW events AS " + " UNION ALL ".join(_branch(k) for k in KIND_NAMES)


def ddl() -> list[str]:
    """The statements that make the kind tables (idempotent) and the ``events`` view."""
    return [_table_ddl(k) for k in KIND_NAMES] + [view_ddl()]


def append_kinds(con: duckdb.DuckDBPyConnection, events: pa.Table, kind_code: np.ndarray) -> None:
    """Insert ``events`` (:data:`EVENTS_SCHEMA` rows, ``kind_code`` per row) into their kinds' tables.

    Runs inside the caller's transaction. Columns null in every row of a kind's part are left to
    DuckDB's default (NULL): passing them costs as much as real data.
    """
    counts = np.bincount(kind_code, minlength=len(KIND_NAMES))
    whole = np.count_nonzero(counts) == 1
    order = None if whole else np.argsort(kind_code, kind="stable")
    start = 0
    for code in np.flatnonzero(counts):
        kind = KIND_NAMES[code]
        n = int(counts[code])
        rows = None if whole else pa.array(order[start:start + n])  # type: ignore[index]
        start += n
        part = {}
        for c in _COLUMNS[kind]:
            col = events.column(c)
            if col.null_count == len(col):
                continue
            part[c] = col if rows is None else col.take(rows)
        tbl = pa.table(part)
        con.register("_kv_kind", tbl)
        try:
            used = ", ".join(part)
            con.execute(f"INSERT INTO {table_name(kind)} ({used}) SELECT {used} FROM _kv_kind")
        finally:
            con.unregister("_kv_kind")


def insert_from(con: duckdb.DuckDBPyConnection, source: str, params: list | None = None) -> int:
    """Insert every row of ``source`` (a relation with the ``events`` columns) into its kind's table.

    Refuses (StoreError, nothing inserted by this call once the caller rolls back) a row whose kind
    is unknown or whose fields its kind does not allow: a kind table has no column for them.
    """
    con.execute(f"CREATE OR REPLACE TEMP TABLE _kv_src AS SELECT * FROM {source}", params)
    try:
        unknown = con.execute("SELECT kind, count(*) FROM _kv_src WHERE kind IS NULL OR kind NOT IN "
                              "(SELECT unnest(?)) GROUP BY ALL LIMIT 1", [list(KIND_NAMES)]).fetchone()
        if unknown:
            raise StoreError(f"events: {unknown[1]} row(s) of unknown kind {unknown[0]!r}")
        total = 0
        for kind in KIND_NAMES:
            stray = [f.name for f in EVENT_VALUE_FIELDS
                     if f.name not in _COLUMNS[kind] and f.name != "kind"]
            if stray:
                bad = con.execute(f"SELECT {', '.join(f'count({c})' for c in stray)} FROM _kv_src "
                                  "WHERE kind = ?", [kind]).fetchone()
                assert bad is not None
                extra = [c for c, n in zip(stray, bad) if n]
                if extra:
                    raise StoreError(f"events of kind {kind} carry field(s) the kind does not allow: "
                                     f"{', '.join(extra)}")
            cols = ", ".join(_COLUMNS[kind])
            row = con.execute(f"INSERT INTO {table_name(kind)} ({cols}) SELECT {cols} FROM _kv_src "
                              "WHERE kind = ? ORDER BY producer_id, seq", [kind]).fetchone()
            total += int(row[0]) if row else 0
        return total
    finally:
        con.execute("DROP TABLE IF EXISTS _kv_src")


def delete_batches(con: duckdb.DuckDBPyConnection, using: str) -> None:
    """Delete the events of the batches listed in table ``using`` (columns producer_id, batch_no)."""
    for t in KIND_TABLES:
        con.execute(f"DELETE FROM {t} USING {using} p WHERE {t}.producer_id = p.producer_id "
                    f"AND {t}.batch_no = p.batch_no")


def missing_columns(con: duckdb.DuckDBPyConnection, names: tuple[str, ...]) -> list[tuple[str, str]]:
    """(table, column) for each field of ``names`` a kind allows but its table lacks (an older store)."""
    rows = con.execute("SELECT table_name, column_name FROM duckdb_columns() WHERE schema_name = 'main' "
                       "AND database_name = current_database() AND table_name LIKE 'events_%'").fetchall()
    have: dict[str, set[str]] = {}
    for t, c in rows:
        have.setdefault(t, set()).add(c)
    return [(table_name(k), n) for k in KIND_NAMES for n in names
            if n in _COLUMNS[k] and table_name(k) in have and n not in have[table_name(k)]]
