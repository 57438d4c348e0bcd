"""The event tables: one narrow table per event kind, a request dictionary, and the ``events`` view.

DuckDB's cost of appending a row grows with the table's width, columns left null included: ~1.2 µs a
row into one 48-column table even when 7 columns carry values, ~0.25 µs into 8 columns (measured on a
store file), and text columns cost most. Store format 2 kept each kind's events in ``events_<kind>``
(identity, clocks, the request fields and the payload fields that kind may carry, and its page-list
lengths). Format 3 also takes the request's text out of the event rows: a request's identity
(``request_id``, ``transfer_id``, ``tenant_id``, ``api_key_id``, as one event carried them) is stored
once in :data:`REQUESTS_TABLE` under a number, and each event row holds that ``request_no``. The
``events`` view is the ``UNION ALL`` of the kind tables joined to the dictionary, with format 1's
columns in its order and types: every query, :func:`kvtrail.audit.store.read_events` and the chain
digest see the same rows as before. A filter on ``kind`` reaches only that kind's table (each
branch's kind is a constant).

The dictionary need not be unique: two numbers may name the same identity (a writer that forgot an
old number takes a new one), since each event's number names exactly what that event carried.

Writers go through this module: :func:`append_kinds` (the store's commit), :func:`insert_from` (import
and migration: a wide relation split by kind) and :func:`delete_batches` (retention).
"""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa

from kvtrail.audit.batch import arrow_type
from kvtrail.audit.events import ALL_FIELDS, KIND_NAMES, KINDS, PAGE_LIST_FIELDS, PRODUCER_FIELDS, REQUEST_NAMES
from kvtrail.errors import StoreError

SQL_TYPES = {
    "str": "VARCHAR",
    "enum": "VARCHAR",
    "int32": "INTEGER",
    "int64": "BIGINT",
    "uint64": "UBIGINT",
    "bool": "BOOLEAN",
    "u64list": "UBIGINT[]",
    "i64list": "BIGINT[]",
}
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
_TYPES.update(
    producer_id="BIGINT", batch_no="BIGINT", num_pages="INTEGER", num_dst_pages="INTEGER", request_no="BIGINT"
)
_NOT_NULL = ("producer_id", "batch_no", "schema_version", "seq", "wall_ns", "mono_ns", "num_pages", "num_dst_pages")
# What every kind's table holds besides its own fields (``kind`` itself is the table).
_ENVELOPE = ("schema_version", "seq", "wall_ns", "mono_ns")
# The request dictionary: one row per request identity (the four request fields as events carried them).
REQUESTS_TABLE = "events_requests"
REQUESTS_SCHEMA = pa.schema(
    [pa.field("request_no", pa.int64())]
    + [pa.field(f.name, arrow_type(f.type)) for f in ALL_FIELDS if f.name in REQUEST_NAMES]
)
_REQUESTS_DDL = (
    f"CREATE TABLE IF NOT EXISTS {REQUESTS_TABLE} (request_no BIGINT NOT NULL, "
    + ", ".join(f"{f.name} {SQL_TYPES[f.type]}" for f in ALL_FIELDS if f.name in REQUEST_NAMES)
    + ")"
)


def table_name(kind: str) -> str:
    """The table that holds the events of ``kind``."""
    return f"events_{kind}"


KIND_TABLES: tuple[str, ...] = tuple(table_name(k) for k in KIND_NAMES)
# Every table the events view reads.
EVENT_TABLES: tuple[str, ...] = (*KIND_TABLES, REQUESTS_TABLE)


def kind_columns(kind: str) -> tuple[str, ...]:
    """The columns of ``kind``'s table: the envelope, ``request_no`` (a kind with request fields), the
    kind's other fields in the view's column order, its page-list lengths."""
    allowed = KINDS[kind].allowed
    cols = ["producer_id", "batch_no"]
    cols += [f.name for f in EVENT_VALUE_FIELDS if f.name in _ENVELOPE]
    cols += ["request_no"] if allowed & set(REQUEST_NAMES) else []
    cols += [
        f.name
        for f in EVENT_VALUE_FIELDS
        if f.name not in _ENVELOPE and f.name in allowed and f.name not in REQUEST_NAMES
    ]
    cols += [n for n, lst in (("num_pages", "pages"), ("num_dst_pages", "dst_pages")) if lst in allowed]
    return tuple(cols)


_COLUMNS = {k: kind_columns(k) for k in KIND_NAMES}


def column_type(name: str) -> str:
    """The SQL type of an ``events`` column (or of a kind table's ``request_no``)."""
    return _TYPES[name]


def _table_ddl(kind: str) -> str:
    cols = ", ".join(f"{c} {_TYPES[c]}{' NOT NULL' if c in _NOT_NULL else ''}" for c in _COLUMNS[kind])
    return f"CREATE TABLE IF NOT EXISTS {table_name(kind)} ({cols})"


def _branch(kind: str, columns: tuple[str, ...] | list[str] | None = None) -> str:
    """One kind's rows with the union's columns (default: the view's, the request fields as ``request_no``)."""
    have = set(_COLUMNS[kind])
    out = []
    for name in _UNION_COLUMNS if columns is None else columns:
        if name == "kind":
            out.append(f"'{kind}'::VARCHAR AS kind")
        elif name in have:
            out.append(name)
        elif name in ("num_pages", "num_dst_pages"):
            out.append(f"0::INTEGER AS {name}")
        else:
            out.append(f"NULL::{_TYPES[name]} AS {name}")
    return f"SELECT {', '.join(out)} FROM {table_name(kind)}"


# The union's columns: the view's, with request_no where the request fields go (they come from the join).
_UNION_COLUMNS = tuple(["request_no"] + [f.name for f in EVENTS_SCHEMA if f.name not in REQUEST_NAMES])


def view_ddl() -> str:
    """``events``: every kind's table joined to the request dictionary, with format 1's columns in its
    order and types. One join above the union (one hash table of the dictionary per query)."""
    cols = ", ".join(f"r.{f.name}" if f.name in REQUEST_NAMES else f"e.{f.name}" for f in EVENTS_SCHEMA)
    union = " UNION ALL ".join(_branch(k) for k in KIND_NAMES)
    return (
        f"CREATE OR REPLACE VIEW events AS SELECT {cols} FROM ({union}) e "
        f"LEFT JOIN {REQUESTS_TABLE} r ON e.request_no = r.request_no"
    )


# The producer identity events_v adds to each event (its view's leading columns).
_IDENTITY = ("cluster", "node", "role", "engine", "engine_version", "instance")


def events_v_rows(columns: tuple[str, ...] | list[str], kinds: tuple[str, ...] | list[str] | None = None) -> str:
    """A FROM item (give it an alias) with ``events_v``'s rows (of ``kinds`` only, if given) but only the
    producer identity and ``columns`` of the events: each kind's table read for those columns alone, the
    request fields joined only when asked for. Binding it costs a fraction of the whole view's (the union
    of every kind over every column: milliseconds of planning per query, whatever it selects). Needs the
    kind tables (:func:`has_kind_tables`); a column ``events`` does not hold raises ValueError."""
    names = [c for c in dict.fromkeys(("producer_id", *columns)) if c not in _IDENTITY]
    unknown = [c for c in names if c not in _TYPES and c not in REQUEST_NAMES and c != "kind"]
    if unknown:
        raise ValueError(f"not a column of events: {', '.join(unknown)}")
    asked = [c for c in names if c in REQUEST_NAMES]
    own = [c for c in names if c not in REQUEST_NAMES] + (["request_no"] if asked else [])
    branches = [_branch(k, own) for k in KIND_NAMES if kinds is None or k in kinds]
    if not branches:
        raise ValueError("events_v_rows: no kind to read")
    cols = [f"p.{c}" for c in _IDENTITY] + [f"e.{c}" for c in own if c != "request_no"] + [f"r.{c}" for c in asked]
    joined = f" LEFT JOIN {REQUESTS_TABLE} r ON e.request_no = r.request_no" if asked else ""
    return (
        f"(SELECT {', '.join(cols)} FROM ({' UNION ALL '.join(branches)}) e{joined} "
        "JOIN producers p USING (producer_id))"
    )


def ddl() -> list[str]:
    """The statements that make the kind tables (idempotent) and the ``events`` view."""
    return [_table_ddl(k) for k in KIND_NAMES] + [_REQUESTS_DDL, view_ddl()]


def append_kinds(
    con: duckdb.DuckDBPyConnection,
    events: pa.Table,
    kind_code: np.ndarray,
    request_no: pa.Array,
    requests: pa.Table | None = None,
) -> None:
    """Insert ``events`` (:data:`EVENTS_SCHEMA` rows, ``kind_code`` and ``request_no`` per row) into their
    kinds' tables, and ``requests`` (:data:`REQUESTS_SCHEMA` rows: the numbers new to the dictionary).

    Runs inside the caller's transaction. Columns null in every row of the batch are left to
    DuckDB's default (NULL): passing them costs as much as real data. The request fields of
    ``events`` are not stored: ``request_no`` stands for them.
    """
    if requests is not None and requests.num_rows:
        con.register("_kv_requests", requests)
        try:
            con.execute(f"INSERT INTO {REQUESTS_TABLE} SELECT * FROM _kv_requests")
        finally:
            con.unregister("_kv_requests")
    # One registration of the whole batch; each kind's rows are picked by DuckDB's filter on the kind code
    # (cheaper than taking every column's rows apart in Arrow first, and done without the GIL).
    tbl = events.append_column("_kv_code", pa.array(kind_code, pa.uint8())).append_column("request_no", request_no)
    con.register("_kv_kind", tbl)
    try:
        for code in np.flatnonzero(np.bincount(kind_code, minlength=len(KIND_NAMES))):
            kind = KIND_NAMES[code]
            used = ", ".join(c for c in _COLUMNS[kind] if tbl.column(c).null_count < tbl.num_rows)
            con.execute(f"INSERT INTO {table_name(kind)} ({used}) SELECT {used} FROM _kv_kind WHERE _kv_code = {code}")
    finally:
        con.unregister("_kv_kind")


_REQ_COLS = ", ".join(REQUEST_NAMES)
_ANY_REQUEST = " OR ".join(f"{n} IS NOT NULL" for n in REQUEST_NAMES)


def insert_from(con: duckdb.DuckDBPyConnection, source: str, params: list | None = None) -> int:
    """Insert every row of ``source`` (a relation with the ``events`` columns) into its kind's table,
    numbering its request identities in the dictionary after the numbers already there.

    Refuses (StoreError, nothing inserted by this call once the caller rolls back) a row whose kind
    is unknown or whose fields its kind does not allow: a kind table has no column for them.
    """
    con.execute(f"CREATE OR REPLACE TEMP TABLE _kv_src AS SELECT * FROM {source}", params)
    try:
        unknown = con.execute(
            "SELECT kind, count(*) FROM _kv_src WHERE kind IS NULL OR kind NOT IN "
            "(SELECT unnest(?)) GROUP BY ALL LIMIT 1",
            [list(KIND_NAMES)],
        ).fetchone()
        if unknown:
            raise StoreError(f"events: {unknown[1]} row(s) of unknown kind {unknown[0]!r}")
        for kind in KIND_NAMES:
            stray = [
                f.name
                for f in EVENT_VALUE_FIELDS
                if f.name not in _COLUMNS[kind]
                and f.name != "kind"
                and not (f.name in REQUEST_NAMES and "request_no" in _COLUMNS[kind])
            ]
            if stray:
                bad = con.execute(
                    f"SELECT {', '.join(f'count({c})' for c in stray)} FROM _kv_src WHERE kind = ?", [kind]
                ).fetchone()
                assert bad is not None
                extra = [c for c, n in zip(stray, bad) if n]
                if extra:
                    raise StoreError(
                        f"events of kind {kind} carry field(s) the kind does not allow: {', '.join(extra)}"
                    )
        con.execute(
            f"CREATE OR REPLACE TEMP TABLE _kv_req AS SELECT (SELECT coalesce(max(request_no) + 1, 0) "
            f"FROM {REQUESTS_TABLE}) + row_number() OVER (ORDER BY {_REQ_COLS}) - 1 AS request_no, "
            f"{_REQ_COLS} FROM (SELECT DISTINCT {_REQ_COLS} FROM _kv_src WHERE {_ANY_REQUEST})"
        )
        con.execute(
            f"INSERT INTO {REQUESTS_TABLE} (request_no, {_REQ_COLS}) SELECT request_no, {_REQ_COLS} FROM _kv_req"
        )
        same = " AND ".join(f"s.{n} IS NOT DISTINCT FROM q.{n}" for n in REQUEST_NAMES)
        total = 0
        for kind in KIND_NAMES:
            cols = ", ".join(_COLUMNS[kind])
            picked = ", ".join("q.request_no" if c == "request_no" else f"s.{c}" for c in _COLUMNS[kind])
            # The dictionary holds no all-null identity, so an event without request fields matches none.
            join = f" LEFT JOIN _kv_req q ON {same}" if "request_no" in _COLUMNS[kind] else ""
            row = con.execute(
                f"INSERT INTO {table_name(kind)} ({cols}) SELECT {picked} FROM _kv_src s{join} "
                "WHERE s.kind = ? ORDER BY s.producer_id, s.seq",
                [kind],
            ).fetchone()
            total += int(row[0]) if row else 0
        return total
    finally:
        con.execute("DROP TABLE IF EXISTS _kv_src")
        con.execute("DROP TABLE IF EXISTS _kv_req")


def delete_batches(con: duckdb.DuckDBPyConnection, using: str) -> None:
    """Delete the events of the batches listed in table ``using`` (columns producer_id, batch_no), and
    the request identities no event names any more (a pruned request leaves nothing of itself)."""
    for t in KIND_TABLES:
        con.execute(
            f"DELETE FROM {t} USING {using} p WHERE {t}.producer_id = p.producer_id AND {t}.batch_no = p.batch_no"
        )
    used = " UNION ALL ".join(
        f"SELECT request_no FROM {table_name(k)} WHERE request_no IS NOT NULL"
        for k in KIND_NAMES
        if "request_no" in _COLUMNS[k]
    )
    con.execute(f"DELETE FROM {REQUESTS_TABLE} WHERE request_no NOT IN ({used})")


def missing_columns(con: duckdb.DuckDBPyConnection, names: tuple[str, ...]) -> list[tuple[str, str]]:
    """(table, column) for each field of ``names`` a kind allows but its table lacks (an older store)."""
    rows = con.execute(
        "SELECT table_name, column_name FROM duckdb_columns() WHERE schema_name = 'main' "
        "AND database_name = current_database() AND table_name LIKE 'events_%'"
    ).fetchall()
    have: dict[str, set[str]] = {}
    for t, c in rows:
        have.setdefault(t, set()).add(c)
    return [
        (table_name(k), n)
        for k in KIND_NAMES
        for n in names
        if n in _COLUMNS[k] and table_name(k) in have and n not in have[table_name(k)]
    ]


def has_kind_tables(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether ``con``'s current catalog holds the kind tables and the request dictionary (a store of this
    format, or a snapshot's views of one), so a query about a few kinds can read their tables and skip the
    ``events`` view: binding that union of every kind costs milliseconds per query, whatever it selects."""
    row = con.execute(
        "SELECT count(*) FROM (SELECT table_name AS name FROM duckdb_tables() WHERE database_name = "
        "current_database() AND schema_name = 'main' UNION ALL SELECT view_name FROM duckdb_views() "
        "WHERE database_name = current_database() AND schema_name = 'main') "
        "WHERE name IN (?, ?, ?, ?, ?, ?, ?)",
        [REQUESTS_TABLE, *(table_name(k) for k in _LOOKED_UP)],
    ).fetchone()
    return bool(row and row[0] == 1 + len(_LOOKED_UP))


# The kinds that queries read from their own tables (has_kind_tables checks that these exist).
_LOOKED_UP = ("node_config", "response_sent", "request_aborted", "recorder_gap", "recorder_started", "recorder_closed")


def kind_rows(kind: str, alias: str = "e") -> str:
    """A FROM item of one kind's rows with their request fields (``request_id``, ``tenant_id``, ...) joined
    from the dictionary (a kind without a request: its table), as ``alias``: the columns ``events`` holds
    for that kind, without the union."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    if "request_no" not in _COLUMNS[kind]:
        return f"{table_name(kind)} {alias}"  # a kind without a request: its table as it is
    cols = ", ".join(f"d.{n}" for n in REQUEST_NAMES)
    return (
        f"(SELECT k.*, {cols} FROM {table_name(kind)} k LEFT JOIN {REQUESTS_TABLE} d "
        f"ON k.request_no = d.request_no) {alias}"
    )
