"""Converting a store of an older format in place: format 1 (one wide ``events`` table) to format 2
(one table per kind, :mod:`kvtrail.audit.layout`).

The conversion is one transaction: the wide table's rows are split into the kind tables, the
``events`` view takes the table's place, and the chain is verified before and after inside that
transaction. It commits only when every event landed in its kind's table and verification finds
exactly what it found before (the same batches and events checked, the same problems, none for an
intact store): the batch digests are computed over the rows as ``events`` returns them, and the view
returns the same rows. Anything else rolls back and leaves the file as it was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import duckdb

from kvtrail.audit.events import ADDED_FIELDS
from kvtrail.audit.layout import KIND_TABLES, column_type, insert_from
from kvtrail.audit.store import fetch_row, schema_ddl
from kvtrail.audit.storefile import MIGRATABLE_FORMATS, STORE_FORMAT, check_store, connect, require_file
from kvtrail.audit.verify import VerifyReport, verify_store
from kvtrail.errors import StoreError

_OLD_TABLE = "events_format1"


@dataclass(frozen=True)
class MigrateResult:
    from_format: str | None  # None: the store was already current
    events: int
    kind_tables: int
    batches_checked: int
    problems: int  # chain problems found before and after (the same ones)
    seconds: float


def _format(con: duckdb.DuckDBPyConnection) -> str | None:
    row = con.execute("SELECT value FROM meta WHERE key = 'store_format'").fetchone()
    return row[0] if row else None


def _is_table(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return fetch_row(con, "SELECT count(*) FROM duckdb_tables() WHERE schema_name = 'main' "
                          "AND database_name = current_database() AND table_name = ?", [name])[0] == 1


def _same(before: VerifyReport, after: VerifyReport) -> bool:
    return ((before.batches_checked, before.events_checked, [str(p) for p in before.problems])
            == (after.batches_checked, after.events_checked, [str(p) for p in after.problems]))


def _convert(con: duckdb.DuckDBPyConnection, path: Path) -> tuple[int, VerifyReport]:
    have = {r[0] for r in con.execute("SELECT column_name FROM duckdb_columns() WHERE schema_name = 'main' AND "
                                      "database_name = current_database() AND table_name = 'events'").fetchall()}
    for name in ADDED_FIELDS:  # a format-1 store older than a field gains it first, as an upgrade did
        if name not in have:
            con.execute(f"ALTER TABLE events ADD COLUMN {name} {column_type(name)}")
    con.execute("DROP VIEW IF EXISTS events_v")
    con.execute("CREATE VIEW events_v AS SELECT p.cluster, p.node, p.role, p.engine, p.engine_version, p.instance, "
                "e.* FROM events e JOIN producers p USING (producer_id)")
    before = verify_store(con)
    old = fetch_row(con, "SELECT count(*) FROM events")[0]
    con.execute("DROP VIEW events_v")
    con.execute(f"ALTER TABLE events RENAME TO {_OLD_TABLE}")
    for stmt in schema_ddl():
        if not stmt.startswith("CREATE OR REPLACE VIEW"):
            con.execute(stmt)
    moved = insert_from(con, _OLD_TABLE)
    if moved != old:
        raise StoreError(f"store {path}: {old} events in the old table, {moved} reached the kind tables")
    con.execute(f"DROP TABLE {_OLD_TABLE}")
    for stmt in schema_ddl():
        if stmt.startswith("CREATE OR REPLACE VIEW"):
            con.execute(stmt)
    after = verify_store(con)
    if not _same(before, after):
        raise StoreError(f"store {path}: verification after the conversion differs from before it "
                         f"({before.first_problem} vs {after.first_problem}); nothing changed")
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
            return MigrateResult(None, 0, len(KIND_TABLES), 0, 0, time.perf_counter() - t0)
        if fmt not in MIGRATABLE_FORMATS or not _is_table(con, "events"):
            check_store(con, path)  # names what the file is instead
            raise StoreError(f"store {path} has format {fmt}; this kvtrail converts format(s) "
                             f"{', '.join(MIGRATABLE_FORMATS)}")
        con.begin()
        try:
            moved, report = _convert(con, path)
            con.commit()
        except BaseException:
            con.rollback()
            raise
        con.execute("CHECKPOINT")
        return MigrateResult(fmt, moved, len(KIND_TABLES), report.batches_checked, len(report.problems),
                             time.perf_counter() - t0)
    except duckdb.Error as exc:
        raise StoreError(f"migration of {path} failed, nothing changed: {str(exc).splitlines()[0]}") from None
    finally:
        con.close()
