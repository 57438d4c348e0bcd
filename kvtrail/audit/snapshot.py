"""A read-only view of an audit store as it was at given chain heads.

A disclosure report records, per producer, the latest committed batch (its number and digest). To
re-run the report's queries later on a store that kept growing, :func:`open_snapshot` exposes the
store's tables through views that keep only batches up to those heads, so the same queries see the
same events. The views carry the tables' names, so every query of ``kvtrail.forensics`` runs unchanged.
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb

from kvtrail.audit.layout import KIND_TABLES
from kvtrail.audit.storefile import migrate_hint
from kvtrail.audit.verify import chain_heads
from kvtrail.errors import StoreError

# Tables whose rows belong to a (producer_id, batch_no); the other tables are copied through as they are.
_BATCHED = (*KIND_TABLES, "page_runs", "batches")


def open_snapshot(path: str | Path, heads: list[dict] | None = None) -> tuple[duckdb.DuckDBPyConnection, list[dict]]:
    """An in-memory connection whose ``events``, ``page_runs``, ``batches``, ``producers`` and
    ``events_v`` show the store at ``heads`` (default: its current heads). Returns (connection, heads)."""
    if not Path(path).exists():
        raise StoreError(f"store not found: {path}")
    con = duckdb.connect()
    try:
        con.execute("ATTACH ? AS src (READ_ONLY)", [str(path)])
        rows = con.execute("SELECT table_name FROM duckdb_tables() WHERE database_name = 'src'").fetchall()
        has = {r[0] for r in rows}
        if not {*_BATCHED, "producers"} <= has:
            if "events" in has:
                raise StoreError(migrate_hint(path, "1"))
            raise StoreError(f"{path} is not a kvtrail audit store")
        if heads is None:
            heads = chain_heads(con, "src.batches", "src.producers")
        con.execute("CREATE TABLE _heads (producer_id BIGINT, batch_no BIGINT)")
        if heads:
            con.executemany("INSERT INTO _heads VALUES (?, ?)", [(h["producer_id"], h["batch_no"]) for h in heads])
        for table in _BATCHED:
            con.execute(f"CREATE VIEW {table} AS SELECT t.* FROM src.{table} t JOIN _heads h "
                        "ON t.producer_id = h.producer_id AND t.batch_no <= h.batch_no")
        con.execute("CREATE VIEW producers AS SELECT * FROM src.producers "
                    "WHERE producer_id IN (SELECT producer_id FROM _heads)")
        for table in sorted(has - set(_BATCHED) - {"producers"}):
            con.execute(f"CREATE VIEW {table} AS SELECT * FROM src.{table}")
        # The store's own events and events_v definitions, re-bound to the views above. Everything lives
        # in the private in-memory database (not TEMP), so cursors of this connection see it too.
        for name in ("events", "events_v"):
            view = con.execute("SELECT sql FROM duckdb_views() WHERE database_name = 'src' "
                               "AND view_name = ?", [name]).fetchone()
            if view is None:
                raise StoreError(f"{path} is not a kvtrail audit store (no {name} view)")
            con.execute(re.sub(r"^CREATE (OR REPLACE )?VIEW", "CREATE VIEW", view[0].strip(), flags=re.I))
    except duckdb.Error as exc:
        con.close()
        raise StoreError(f"cannot open store {path}: {str(exc).splitlines()[0]}") from None
    except BaseException:
        con.close()
        raise
    return con, heads
