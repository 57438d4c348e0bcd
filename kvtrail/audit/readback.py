"""Reading events back out of a store: an Arrow query, and a filter's events as a wire-shaped batch
(producer identity and page lists restored from the page runs), both on one snapshot."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.arrowutil import list_array
from kvtrail.audit.events import ALL_FIELDS, KIND_NAMES, KINDS, PAGE_LIST_FIELDS
from kvtrail.audit.pagelist import decode_runs


def arrow_query(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> pa.Table:
    """Run a query and return its result as an Arrow table."""
    con.complete()  # DuckDB refuses a new query while an earlier execute() result is still open
    return con.sql(sql, params=params or None).to_arrow_table()


def _read_events_snapshot(con, where: str, params: list | None) -> tuple[pa.Table, pa.Table]:
    ev = arrow_query(con, f"SELECT * FROM events_v WHERE {where} ORDER BY producer_id, seq", params)
    runs = arrow_query(
        con,
        f"WITH e AS (SELECT producer_id, seq, row_number() OVER (ORDER BY producer_id, seq) - 1 AS row "
        f"FROM events_v WHERE {where}) "
        f"SELECT e.row, r.list, r.page_start, r.num_pages FROM page_runs r JOIN e USING (producer_id, seq) "
        f"ORDER BY e.row, r.list, r.pos",
        params,
    )
    return ev, runs


def read_events(con: duckdb.DuckDBPyConnection, where: str = "TRUE", params: list | None = None) -> pa.Table:
    """Read events back as a wire-shaped batch (producer identity and page lists restored).

    ``where`` filters the ``events_v`` view (events with producer identity). Rows come in
    (producer_id, seq) order.
    """
    con.complete()
    con.begin()  # both queries must see the same snapshot, or page lists could attach to wrong events
    try:
        ev, runs = _read_events_snapshot(con, where, params)
    finally:
        con.commit()
    out = {f.name: ev.column(f.name) for f in ALL_FIELDS if f.name not in PAGE_LIST_FIELDS}

    row = runs.column("row").to_numpy().astype(np.int64)
    lists = runs.column("list").to_numpy()
    for list_no, name in enumerate(PAGE_LIST_FIELDS):
        m = lists == list_no
        flat, offsets = decode_runs(
            ev.num_rows, row[m], runs.column("page_start").to_numpy()[m], runs.column("num_pages").to_numpy()[m]
        )
        # A kind that requires a list always carries one (possibly empty); other kinds carry none.
        needs = [k for k in KIND_NAMES if name in KINDS[k].required]
        present = pc.is_in(ev.column("kind"), value_set=pa.array(needs)).to_numpy(zero_copy_only=False)
        out[name] = list_array(flat, offsets, pa.int32(), ~present, field=name)
    return pa.table({f.name: out[f.name] for f in ALL_FIELDS})
