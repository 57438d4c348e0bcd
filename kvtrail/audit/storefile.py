"""The store's file on disk: opening it with one-line errors, and telling a kvtrail store from anything else.

A store is the DuckDB file ``<db>`` plus, between checkpoints, its write-ahead log ``<db>.wal``.
Committed batches reach the WAL first and the main file only at a checkpoint, so a copy of the
main file alone can be an empty database (nothing checkpointed yet) or an older state of the
store. :func:`check_store` refuses the first kind naming the WAL; ``kvtrail audit backup`` makes
copies that need no WAL.
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb

from kvtrail.audit.events import ADDED_FIELDS, ADDED_KINDS
from kvtrail.audit.layout import EVENT_TABLES, missing_columns, table_name
from kvtrail.errors import StoreError

# Format 3 keeps events in one table per kind and request identities in a dictionary
# (kvtrail.audit.layout); format 2 had the request fields in every kind table's rows, format 1 one
# wide events table. 'kvtrail audit migrate' converts both.
STORE_FORMAT = "3"
MIGRATABLE_FORMATS = ("1", "2")
_FORMAT_LAYOUTS = {"1": "one wide events table", "2": "request fields in every event row"}
# Every table a kvtrail store of this format has; store_opens came later and is created on the
# next writable open of an older store, so a read-only open does not require it.
# The tables of kinds added later (events.ADDED_KINDS) are made on the next writable open of an older store.
ADDED_TABLES = tuple(table_name(k) for k in ADDED_KINDS)
STORE_TABLES = (
    "meta",
    "producers",
    *(t for t in EVENT_TABLES if t not in ADDED_TABLES),
    "page_runs",
    "batches",
    "prunes",
    "prune_batches",
    "legal_holds",
)
OPENS_TABLE = "store_opens"
_LOCK_PID = re.compile(r"\(PID (\d+)\)")


def wal_path(path: str | Path) -> Path:
    """Where DuckDB keeps the write-ahead log of the database at ``path``."""
    return Path(f"{path}.wal")


def backup_hint(path: str | Path) -> str:
    return (
        f"if it was copied from a store, the data may be in {Path(path).name}.wal next to the original; "
        "'kvtrail audit backup' makes a single-file copy"
    )


# A DuckDB database file carries this at byte 8 of its first block.
_DUCKDB_MAGIC, _MAGIC_AT = b"DUCK", 8
# What a file that is not a database often is (the header's first bytes, how to name it).
_FOREIGN_HEADS = (
    (b"{", "JSON text"),
    (b"[", "JSON text"),
    (b"PAR1", "a Parquet file"),
    (b"SQLite format 3", "an SQLite database"),
    (b"ARROW1", "an Arrow file"),
)


def refuse_foreign_file(path: str | Path) -> None:
    """StoreError unless ``path`` is missing, empty or starts like a DuckDB database: DuckDB itself would
    open a ``.json``, ``.csv`` or ``.parquet`` file as an in-memory view of its data, and say only that an
    in-memory database cannot be read-only."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            head = f.read(64)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return  # DuckDB's own error names these
    if not head or head[_MAGIC_AT : _MAGIC_AT + len(_DUCKDB_MAGIC)] == _DUCKDB_MAGIC:
        return
    kind = next((name for start, name in _FOREIGN_HEADS if head.lstrip().startswith(start)), None)
    raise StoreError(f"{path} is not a DuckDB database file" + (f" ({kind}): not a kvtrail store" if kind else ""))


def connect(path: str | Path, *, read_only: bool) -> duckdb.DuckDBPyConnection:
    """Open ``path`` with DuckDB, turning its errors into one-line StoreErrors (another process
    holding the lock, a file that is not a DuckDB database, an unreadable WAL)."""
    refuse_foreign_file(path)
    try:
        return duckdb.connect(str(path), read_only=read_only)
    except duckdb.Error as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "Could not set lock" in first:
            pid = _LOCK_PID.search(first)
            owner = f" (pid {pid.group(1)})" if pid else ""
            raise StoreError(
                f"store {path} is in use by another process{owner}: DuckDB lets one process open it "
                "at a time; 'kvtrail audit backup' copies it while it runs"
            ) from None
        if "not a valid DuckDB database file" in first:
            raise StoreError(f"{path} is not a DuckDB database file") from None
        raise StoreError(f"cannot open store {path}: {first}") from None


def store_tables(con: duckdb.DuckDBPyConnection) -> set[str]:
    """Names of the tables in the main schema of the database ``con`` is attached to."""
    rows = con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' AND database_name = current_database()"
    ).fetchall()
    return {r[0] for r in rows}


def missing_added_columns(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str]]:
    """(table, column) of event fields added later (``kvtrail.audit.events.ADDED_FIELDS``) that the
    store's kind tables do not have yet: a store written by an older kvtrail."""
    return missing_columns(con, ADDED_FIELDS)


def migrate_hint(path: str | Path, found: str) -> str:
    layout = _FORMAT_LAYOUTS.get(found)
    return (
        f"store {path} has format {found}{f' ({layout})' if layout else ''}; 'kvtrail audit migrate --db "
        f"{path}' converts it to format {STORE_FORMAT} in place (its chain stays valid)"
    )


def check_store(con: duckdb.DuckDBPyConnection, path: str | Path, *, upgrading: bool = False) -> None:
    """Raise StoreError (one line naming ``path``) unless ``con`` holds a complete kvtrail store of this format
    (``upgrading``: a writable open, which adds the columns of later fields itself)."""
    tables = store_tables(con)
    if not tables:
        raise StoreError(f"{path} is an empty DuckDB database, not a kvtrail store; {backup_hint(path)}")
    if "meta" not in tables:
        shown = ", ".join(sorted(tables)[:5]) + (", ..." if len(tables) > 5 else "")
        raise StoreError(f"{path} is a DuckDB database but not a kvtrail store (it holds {shown})")
    fmt = con.execute("SELECT value FROM meta WHERE key = 'store_format'").fetchone()
    if fmt is not None and fmt[0] in MIGRATABLE_FORMATS:
        raise StoreError(migrate_hint(path, fmt[0]))
    if fmt is None or fmt[0] != STORE_FORMAT:
        found = fmt[0] if fmt else "unknown"
        raise StoreError(f"store {path} has format {found}; this kvtrail reads format {STORE_FORMAT}")
    missing = [t for t in STORE_TABLES if t not in tables]
    if missing:
        raise StoreError(f"store {path} is incomplete: table(s) {', '.join(missing)} missing; {backup_hint(path)}")
    older = [] if upgrading else sorted({name for _table, name in missing_added_columns(con)})
    older += [] if upgrading else [f"{t} table" for t in ADDED_TABLES if t not in tables]
    if older:
        raise StoreError(
            f"store {path} was written by an older kvtrail (its events have no {', '.join(older)}): "
            f"'kvtrail audit upgrade --db {path}' adds them (its chain stays valid)"
        )


def require_file(path: str | Path) -> Path:
    """``path`` as a Path if it exists; else StoreError, naming a WAL that was left without its database."""
    p = Path(path)
    if p.exists():
        return p
    if wal_path(p).exists():
        raise StoreError(
            f"store not found: {p}, but {wal_path(p).name} is there: a WAL cannot be opened "
            "without the database file it belongs to"
        )
    raise StoreError(f"store not found: {p}")
