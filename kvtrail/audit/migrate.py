"""Converting a store of an older format in place to format 3 (one table per kind and a request
dictionary, :mod:`kvtrail.audit.layout`): format 1 (one wide ``events`` table) and format 2 (one table
per kind with the request fields in every row).

The conversion is one transaction: the old rows (format 1's table, or what format 2's ``events`` view
returns) are split into the kind tables and the dictionary, the ``events`` view takes the old
table's or view's place, and the chain is verified before and after inside that transaction. It
commits only when every event landed in its kind's table and verification finds exactly what it
found before (the same batches and events checked, the same problems, none for an
intact store): the batch digests are computed over the rows as ``events`` returns them, and the view
returns the same rows. Anything else rolls back and leaves the file as it was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import duckdb

from kvtrail.audit.events import ADDED_FIELDS
from kvtrail.audit.layout import KIND_TABLES, REQUESTS_TABLE, column_type, insert_from
from kvtrail.audit.store import fetch_row, schema_ddl
from kvtrail.audit.storefile import MIGRATABLE_FORMATS, STORE_FORMAT, check_store, connect, require_file
from kvtrail.audit.verify import VerifyReport, verify_store
from kvtrail.errors import StoreError

_OLD_TABLE = "events_format1"
_OLD_ROWS = "_kv_format2_events"
_OLD_VIEW = "_kv_format2_view"


@dataclass(frozen=True)
class MigrateResult:
    from_format: str | None  # None: the store was already current
    events: int
    kind_tables: int
    requests: int  # rows of the request dictionary after the conversion
    batches_checked: int
    problems: int  # chain problems found before and after (the same ones)
    seconds: float


def _format(con: duckdb.DuckDBPyConnection) -> str | None:
    row = con.execute("SELECT value FROM meta WHERE key = 'store_format'").fetchone()
    return row[0] if row else None


def _is_table(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return (
        fetch_row(
            con,
            "SELECT count(*) FROM duckdb_tables() WHERE schema_name = 'main' "
            "AND database_name = current_database() AND table_name = ?",
            [name],
        )[0]
        == 1
    )


def _same(before: VerifyReport, after: VerifyReport) -> bool:
    return (before.batches_checked, before.events_checked, [str(p) for p in before.problems]) == (
        after.batches_checked,
        after.events_checked,
        [str(p) for p in after.problems],
    )


def _events_v(con: duckdb.DuckDBPyConnection) -> None:
    con.execute("DROP VIEW IF EXISTS events_v")
    con.execute(
        "CREATE VIEW events_v AS SELECT p.cluster, p.node, p.role, p.engine, p.engine_version, p.instance, "
        "e.* FROM events e JOIN producers p USING (producer_id)"
    )


def _add_later_fields_format1(con: duckdb.DuckDBPyConnection) -> None:
    """Format 1's wide table gains the fields added later first, as an upgrade did."""
    have = {
        r[0]
        for r in con.execute(
            "SELECT column_name FROM duckdb_columns() WHERE schema_name = 'main' AND "
            "database_name = current_database() AND table_name = 'events'"
        ).fetchall()
    }
    for name in ADDED_FIELDS:
        if name not in have:
            con.execute(f"ALTER TABLE events ADD COLUMN {name} {column_type(name)}")


def _take_old_rows(con: duckdb.DuckDBPyConnection, fmt: str) -> str:
    """Move the old rows out of the way of format 3's tables; returns the relation that holds them."""
    con.execute("DROP VIEW events_v")
    if fmt == "1":
        con.execute(f"ALTER TABLE events RENAME TO {_OLD_TABLE}")
        return _OLD_TABLE
    # Format 2: its kind tables have format 3's names, so its rows are copied out through its own view.
    con.execute(f"CREATE TEMP TABLE {_OLD_ROWS} AS SELECT * FROM events")
    con.execute("DROP VIEW events")
    con.execute(f"DROP VIEW IF EXISTS {_OLD_VIEW}")
    for table in KIND_TABLES:
        con.execute(f"DROP TABLE IF EXISTS {table}")  # kinds added later have no table in a format-2 store
    return _OLD_ROWS


def _add_later_fields_format2(con: duckdb.DuckDBPyConnection) -> None:
    """Format 2's events view gains the fields added after it was written, as nulls: its own view under
    another name, wrapped."""
    have = {
        r[0]
        for r in con.execute(
            "SELECT column_name FROM duckdb_columns() WHERE schema_name = 'main' AND "
            "database_name = current_database() AND table_name = 'events'"
        ).fetchall()
    }
    later = [n for n in ADDED_FIELDS if n not in have]
    if later:
        con.execute(f"ALTER VIEW events RENAME TO {_OLD_VIEW}")
        added = ", ".join(f"NULL::{column_type(n)} AS {n}" for n in later)
        con.execute(f"CREATE VIEW events AS SELECT *, {added} FROM {_OLD_VIEW}")


def _convert(con: duckdb.DuckDBPyConnection, path: Path, fmt: str) -> tuple[int, VerifyReport]:
    if fmt == "1":
        _add_later_fields_format1(con)
    else:
        _add_later_fields_format2(con)
    _events_v(con)
    before = verify_store(con)
    old = fetch_row(con, "SELECT count(*) FROM events")[0]
    source = _take_old_rows(con, fmt)
    for stmt in schema_ddl():
        if not stmt.startswith("CREATE OR REPLACE VIEW"):
            con.execute(stmt)
    moved = insert_from(con, source)
    if moved != old:
        raise StoreError(f"store {path}: {old} events in the old table, {moved} reached the kind tables")
    con.execute(f"DROP TABLE {source}")
    for stmt in schema_ddl():
        if stmt.startswith("CREATE OR REPLACE VIEW"):
            con.execute(stmt)
    after = verify_store(con)
    if not _same(before, after):
        raise StoreError(
            f"store {path}: verification after the conversion differs from before it "
            f"({before.first_problem} vs {after.first_problem}); nothing changed"
        )
    con.execute("UPDATE meta SET value = ? WHERE key = 'store_format'", [STORE_FORMAT])
    con.execute("INSERT OR REPLACE INTO meta VALUES ('migrated_ns', ?)", [str(time.time_ns())])
    return int(moved), before


def migrate_store(path: str | Path) -> MigrateResult:
    """Convert the store at ``path`` to this kvtrail's format in place (see the module docstring).

    Returns ``from_format=None`` for a store that is already current. Raises StoreError (the file
    unchanged) for a file that is not a kvtrail store, a format this kvtrail cannot convert, a store
    another process holds, and a conversion that would not keep every event and the chain as they were.
    """
    path = require_file(path)
    t0 = time.perf_counter()
    con = connect(path, read_only=False)
    try:
        fmt = _format(con) if _is_table(con, "meta") else None
        if fmt == STORE_FORMAT:
            check_store(con, path, upgrading=True)
            return MigrateResult(None, 0, len(KIND_TABLES), 0, 0, 0, time.perf_counter() - t0)
        if fmt not in MIGRATABLE_FORMATS or (fmt == "1") != _is_table(con, "events"):
            check_store(con, path)  # names what the file is instead
            raise StoreError(
                f"store {path} has format {fmt}; this kvtrail converts format(s) {', '.join(MIGRATABLE_FORMATS)}"
            )
        con.begin()
        try:
            moved, report = _convert(con, path, fmt)
            con.commit()
        except BaseException:
            con.rollback()
            raise
        con.execute("CHECKPOINT")
        requests = fetch_row(con, f"SELECT count(*) FROM {REQUESTS_TABLE}")[0]
        return MigrateResult(
            fmt,
            moved,
            len(KIND_TABLES),
            int(requests),
            report.batches_checked,
            len(report.problems),
            time.perf_counter() - t0,
        )
    except duckdb.Error as exc:
        raise StoreError(f"migration of {path} failed, nothing changed: {str(exc).splitlines()[0]}") from None
    finally:
        con.close()
