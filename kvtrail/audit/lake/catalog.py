"""A lake (or some of its files) seen as a store: an in-memory DuckDB with the store's tables as views.

The views have the store's names and column types (``events``, ``events_v``, ``page_runs``,
``producers``, ``batches``, ...), so the chain check (:func:`kvtrail.audit.verify.verify_store`), the
questions' SQL and the replay's reader (:func:`kvtrail.forensics.replay.source.store_batches`) run on a
lake unchanged. Local files are read by DuckDB itself; files on S3 through pyarrow datasets (DuckDB
2.x cannot load ``httpfs`` offline), which DuckDB scans lazily. Only files the manifest lists are read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import duckdb
import pyarrow as pa
import pyarrow.dataset as pads

from kvtrail.audit.events import ADDED_FIELDS
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.store import schema_ddl
from kvtrail.errors import StoreError

# Every table of a store (the kind tables and request dictionary are one wide ``events``), in the order an
# import loads them (producers first: a producer the target holds is refused before any heavy reading),
# each with its key, the order its rows are written in.
STORE_TABLES = {
    "producers": "producer_id",
    "meta": "key",
    "batches": "producer_id, batch_no",
    "events": "producer_id, seq",
    "page_runs": "producer_id, seq, list, pos",
    "prunes": "prune_id",
    "prune_batches": "prune_id, producer_id, batch_no",
    "legal_holds": "hold_id",
}
# Tables every export writes files of; the rest only a whole-store export writes (one store's own records).
LAKE_TABLES = ("producers", "batches", "events", "page_runs")
WHOLE_STORE_TABLES = tuple(t for t in STORE_TABLES if t not in LAKE_TABLES)
_EVENTS_V = (
    "CREATE VIEW events_v AS SELECT p.cluster, p.node, p.role, p.engine, p.engine_version, p.instance, e.* "
    "FROM events e JOIN producers p USING (producer_id)"
)


def select_list(table: str, file_cols: list[tuple[str, str]], table_cols: list[tuple[str, str]]) -> str:
    """The store table's columns as a select list over files with ``file_cols`` ((name, type) pairs): the
    later fields the files lack as typed nulls; StoreError for any other difference."""
    have = {name for name, _ in file_cols}
    later = [(n, t) for n, t in table_cols if n not in have and n in ADDED_FIELDS] if table == "events" else []
    expected = [c for c in table_cols if c not in later]
    if file_cols != expected:
        diff = next((f"{a} vs {b}" for a, b in zip(file_cols, expected) if a != b), f"{file_cols} vs {expected}")
        raise StoreError(f"{table}: exported columns do not match the store's ({diff})")
    return ", ".join(f"NULL::{t} AS {n}" if (n, t) in later else n for n, t in table_cols)


def _lit(path: str) -> str:
    return "'" + path.replace("'", "''") + "'"


def _view(con: duckdb.DuckDBPyConnection, lake: LakeFS, table: str, paths: list[str]) -> None:
    if lake.is_local:
        listed = ", ".join(_lit(lake.full(p)) for p in paths)
        src = f"read_parquet([{listed}], hive_partitioning=false)"
    else:
        ds = pads.dataset([lake.full(p) for p in paths], filesystem=lake.fs, format="parquet")
        con.register(f"_lake_{table}", ds)
        src = f"_lake_{table}"
    have = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {src}").fetchall()}
    # files written before an event field was added lack its column: read as null
    table_cols = [(r[0], r[1]) for r in con.execute(f"DESCRIBE ref.{table}").fetchall()]
    cols = ", ".join(
        f"NULL::{t} AS {n}" if table == "events" and n not in have and n in ADDED_FIELDS else n for n, t in table_cols
    )
    con.execute(f"CREATE VIEW {table} AS SELECT {cols} FROM {src}")


def _over(con: duckdb.DuckDBPyConnection, tables: dict[str, pa.Table], views: bool = True) -> duckdb.DuckDBPyConnection:
    """``con`` with ``tables`` registered and (``views``) the store's views over them."""
    for table in LAKE_TABLES:
        con.register(f"_lake_{table}", tables[table])
        if views:
            con.execute(f"CREATE OR REPLACE VIEW {table} AS SELECT * FROM _lake_{table}")
    if views:
        con.execute(_EVENTS_V.replace("CREATE VIEW", "CREATE OR REPLACE VIEW"))
    return con


def open_memory_catalog(tables: dict[str, pa.Table], threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """A connection over tables already read (each of :data:`LAKE_TABLES`): what a task checked is what it
    reads. ``threads``: DuckDB's threads (None: its default, one per core)."""
    return _over(duckdb.connect(config={} if threads is None else {"threads": threads}), tables)


_KEPT = threading.local()  # this thread's kept connection: (threads, its views' schemas, connection)


@contextmanager
def memory_catalog(tables: dict[str, pa.Table], threads: int | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
    """:func:`open_memory_catalog` on a connection the calling thread keeps from one call to the next:
    connecting costs ~25 ms of CPU, a fixed cost of every lake task. The call's tables are registered for
    the call only (unregistered after it; the views are made again when their schemas differ from the
    last call's); a call that raised leaves no connection behind (whatever state it left is not carried
    into the next)."""
    kept = getattr(_KEPT, "con", None)
    if kept is None or kept[0] != threads:
        if kept is not None:
            kept[2].close()
        kept = (threads, None, duckdb.connect(config={} if threads is None else {"threads": threads}))
    schemas = tuple(tables[t].schema for t in LAKE_TABLES)
    con = kept[2]
    _KEPT.con = None  # kept again only once the call ends well
    try:
        yield _over(con, tables, views=schemas != kept[1])
    except BaseException:
        con.close()
        raise
    for table in LAKE_TABLES:
        con.unregister(f"_lake_{table}")
    _KEPT.con = (threads, schemas, con)


def open_catalog(lake: LakeFS, files: dict[str, list[str]]) -> duckdb.DuckDBPyConnection:
    """A connection whose store tables read ``files`` (table -> lake-relative paths) of ``lake``."""
    con = duckdb.connect()
    con.execute("CREATE SCHEMA ref")
    con.execute("USE memory.ref")
    for stmt in schema_ddl():
        if not stmt.startswith("CREATE OR REPLACE VIEW events_v"):
            con.execute(stmt)
    con.execute("USE memory.main")
    # The kind tables and the request dictionary stay hidden: a lake's events are one wide table, read
    # through the ``events`` view.
    tables = [
        r[0]
        for r in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'ref' "
            "AND NOT starts_with(table_name, 'events_')"
        ).fetchall()
    ]
    tables += ["events"]
    for table in tables:
        paths = files.get(table, [])
        if not paths:
            con.execute(f"CREATE VIEW {table} AS SELECT * FROM ref.{table}")
        else:
            _view(con, lake, table, paths)
    con.execute(_EVENTS_V)
    return con
