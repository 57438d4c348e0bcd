"""``kvtrail model validate`` on a store: every producer's events up to the window's end through the
monitors (:mod:`kvtrail.model.monitors`), violations from its start; the store's own coverage gaps
(events a producer numbered that the store does not hold) reported as "cannot tell" for every property."""

from __future__ import annotations

import duckdb

from kvtrail.audit.store import read_events
from kvtrail.forensics import Window, check_window, coverage_gaps
from kvtrail.model.monitors import Monitors, judge_order
from kvtrail.model.properties import PROPERTIES


def validate_store(con: duckdb.DuckDBPyConnection, w: Window | None = None) -> dict:
    """``{"violations": [...], "coverage": [...]}`` for the store's history in the window."""
    w = w or Window()
    check_window(con, w)
    where, params = ("wall_ns <= ?", [w.to_ns]) if w.to_ns is not None else ("TRUE", [])
    table = read_events(con, where, params)
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
