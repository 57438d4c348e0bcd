"""A lake task's catalog on a connection its thread keeps: each call sees its own tables only, views follow a
schema that changed, and a call that raised leaves no connection behind."""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pytest

from kvtrail.audit.lake import catalog
from kvtrail.audit.lake.catalog import LAKE_TABLES, memory_catalog
from kvtrail.forensics.replay.batch import PRODUCER_NAMES


def _tables(node: str, extra: bool = False) -> dict[str, pa.Table]:
    out = {
        t: pa.table({"producer_id": pa.array([7], pa.int64()), "seq": pa.array([1], pa.int64())}) for t in LAKE_TABLES
    }
    producers = {"producer_id": pa.array([7], pa.int64()), **{c: pa.array([node], pa.string()) for c in PRODUCER_NAMES}}
    out["producers"] = pa.table(producers)
    if extra:
        out["events"] = out["events"].append_column("later_field", pa.array([42], pa.int64()))
    return out


def test_calls_share_a_connection_and_see_only_their_own_tables():
    with memory_catalog(_tables("a"), 1) as con:
        first = con
        assert con.execute("SELECT node FROM events_v").fetchall() == [("a",)]
    with memory_catalog(_tables("b", extra=True), 1) as con:
        assert con is first  # kept, not connected again
        assert con.execute("SELECT node, later_field FROM events_v").fetchall() == [("b", 42)]
    with memory_catalog(_tables("c"), 1) as con:  # the view follows the schema back
        assert con.execute("SELECT node FROM events_v").fetchall() == [("c",)]
        with pytest.raises(duckdb.BinderException):
            con.execute("SELECT later_field FROM events").fetchall()
    with memory_catalog(_tables("d"), 2) as con:  # another thread count: another connection
        assert con is not first
        assert con.execute("SELECT current_setting('threads')").fetchall() == [(2,)]


def test_a_call_that_raised_leaves_no_connection_behind():
    with pytest.raises(RuntimeError, match="task failed"):
        with memory_catalog(_tables("a"), 1) as con:
            failed = con
            con.begin()  # a transaction left open
            raise RuntimeError("task failed")
    assert getattr(catalog._KEPT, "con", None) is None
    with pytest.raises(duckdb.ConnectionException):
        failed.execute("SELECT 1")
    with memory_catalog(_tables("b"), 1) as con:
        assert con is not failed
        con.begin()  # a fresh connection: no transaction carried over
        assert con.execute("SELECT node FROM events_v").fetchall() == [("b",)]
        con.commit()
