"""``kvtrail model validate`` on a store: every producer's events up to the window's end through the
monitors (:mod:`kvtrail.model.monitors`), violations from its start; the store's own coverage gaps
(events a producer numbered that the store does not hold) reported as "cannot tell" for every property."""

from __future__ import annotations

import threading

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.arrowutil import list_array
from kvtrail.audit.events import KIND_NAMES, KINDS, PAGE_LIST_FIELDS
from kvtrail.audit.readback import arrow_query
from kvtrail.forensics import Window, check_window, coverage_gaps
from kvtrail.model.monitors import COLUMNS, Monitors, judge_order
from kvtrail.model.pagekernel import warm_up
from kvtrail.model.properties import PROPERTIES

_WITH_PAGES = [k for k in KIND_NAMES if "pages" in KINDS[k].required]


def _decode_pages(
    num_rows: int, row: np.ndarray, start: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Page lists (flat int32 values, int64 offsets) from their runs (in row order, then position): the
    inverse of the store's run encoding, as :func:`~kvtrail.audit.pagelist.decode_runs` but in two passes
    over one int32 array (each run's first entry is its step from the previous run's last page, every other
    entry a step of one, summed), so a history of many pages costs no int64 temporaries per page."""
    ends = np.cumsum(length, dtype=np.int64)
    offsets = np.zeros(num_rows + 1, np.int64)
    if len(ends):
        offsets[1:] = np.concatenate([[0], ends])[np.searchsorted(row, np.arange(num_rows), side="right")]
    flat = np.ones(int(ends[-1]) if len(ends) else 0, np.int32)
    keep = length > 0
    first = np.asarray(start[keep], np.int64)
    n = np.asarray(length[keep], np.int64)
    if len(first):
        step = np.empty(len(first), np.int64)
        step[0] = first[0]
        step[1:] = first[1:] - (first[:-1] + n[:-1] - 1)
        flat[np.cumsum(n) - n] = step.astype(np.int32)  # a step fits: pages are non-negative int32
        np.cumsum(flat, dtype=np.int32, out=flat)  # each partial sum is a page id: no overflow
    return flat, offsets


def read_for_monitors(con: duckdb.DuckDBPyConnection, where: str, params: list) -> pa.Table:
    """The events ``where`` selects, only the columns the monitors read, page lists restored from their
    runs (``pages`` only), both read on one snapshot. A lean :func:`~kvtrail.audit.store.read_events`:
    the monitors need a quarter of the columns and one of the two page lists."""
    con.complete()
    con.begin()
    try:
        ev = arrow_query(
            con, f"SELECT {', '.join(COLUMNS)} FROM events_v WHERE {where} ORDER BY producer_id, seq", params
        )
        runs = arrow_query(
            con,
            f"WITH e AS (SELECT producer_id, seq, row_number() OVER (ORDER BY producer_id, seq) - 1 AS row "
            f"FROM events_v WHERE {where}) "
            f"SELECT e.row, r.page_start, r.num_pages FROM page_runs r JOIN e USING (producer_id, seq) "
            f"WHERE r.list = ? ORDER BY e.row, r.pos",
            [*params, PAGE_LIST_FIELDS.index("pages")],
        )
    finally:
        con.commit()
    flat, offsets = _decode_pages(
        ev.num_rows,
        runs.column("row").to_numpy(),
        runs.column("page_start").to_numpy(),
        runs.column("num_pages").to_numpy(),
    )
    present = pc.is_in(ev.column("kind"), value_set=pa.array(_WITH_PAGES)).to_numpy(zero_copy_only=False)
    return ev.append_column("pages", list_array(flat, offsets, pa.int32(), ~present, field="pages"))


def validate_store(con: duckdb.DuckDBPyConnection, w: Window | None = None) -> dict:
    """``{"violations": [...], "coverage": [...]}`` for the store's history in the window."""
    w = w or Window()
    check_window(con, w)
    where, params = ("wall_ns <= ?", [w.to_ns]) if w.to_ns is not None else ("TRUE", [])
    loading = threading.Thread(target=warm_up, daemon=True)  # while the store is read
    loading.start()
    table = read_for_monitors(con, where, params)
    loading.join()
    mon = Monitors(w.from_ns)
    mon.feed(table, judge_order(table))
    coverage = mon.coverage()
    for gap in coverage_gaps(con, w).iter_rows(named=True):
        coverage.append(
            {
                "property": "*",
                "cannot_tell": f"{gap['unexplained']} events of {gap['node']} ({gap['instance']}) are not in the store",
                "events": gap["unexplained"],
                "first_event": None,
            }
        )
    violations = sorted(mon.violations, key=lambda v: (v.wall_ns, v.producer, v.seq, v.property))
    return {
        "violations": [v.as_dict() for v in violations],
        "coverage": coverage,
        "events": mon.events,
        "properties": list(PROPERTIES),
    }
