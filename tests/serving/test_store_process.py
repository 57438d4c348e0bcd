"""The stack's store process: recorders commit through its relay, reads come back over its pipe, and it
closes the store cleanly on stop or when the router that started it is gone."""

import duckdb
import pytest

from kvtrail.audit.events import Producer, RequestRef
from kvtrail.audit.recorder import Recorder
from kvtrail.audit.relay import RelaySink
from kvtrail.audit.store import AuditStore
from kvtrail.audit.verify import verify_store
from kvtrail.errors import KvtrailError
from kvtrail.serving.store_process import StoreProcess


def _record(store: StoreProcess, n: int) -> dict[str, int]:
    assert store.address is not None and store.authkey is not None
    rec = Recorder(
        RelaySink(store.address, store.authkey),
        Producer("c1", "decode-0", "decode", "kvtrail-reference", "0.1", "decode-1"),
    )
    rec.node_config(pool_tokens=64 * 16, pool_pages=64, page_size=16, context_tokens=4096)
    for i in range(n):
        rec.pages_allocated(RequestRef(f"r{i}", i, "acme"), [1 + i % 60, 2 + i % 60], "decode_reservation")
    assert rec.flush(30)
    stats = rec.stats()
    rec.close()
    return stats


def test_recorders_commit_through_it_and_reads_come_back(tmp_path):
    db = tmp_path / "s.duckdb"
    store = StoreProcess(db).start()
    try:
        assert store.pid is not None
        stats = _record(store, 40)
        assert stats["committed_events_total"] == 42  # recorder_started, node_config, the 40
        assert stats["writer_cpu_ns_total"] > 0
        assert store.query("SELECT count(*) FROM events WHERE kind = ?", ["pages_allocated"]) == [(40,)]
        cur = store.cursor()
        assert cur.execute("SELECT count(*), sum(num_pages) FROM events").fetchone() == (43, 80)  # + closed
        assert cur.fetchone() is None
        with pytest.raises(KvtrailError, match="store query failed"):
            store.query("SELECT no_such_column FROM events")
    finally:
        store.stop()
    assert store.pid is None
    with pytest.raises(KvtrailError, match="not running"):
        store.query("SELECT 1")
    assert verify_store(db).ok
    con = duckdb.connect(str(db), read_only=True)  # the process released the file
    try:
        assert con.execute("SELECT count(*) FROM events").fetchone() == (43,)
    finally:
        con.close()


def test_a_store_it_cannot_open_fails_the_start_with_the_reason(tmp_path):
    db = tmp_path / "held.duckdb"
    holder = AuditStore(db)  # this process holds the file for writing
    try:
        with pytest.raises(KvtrailError) as err:
            StoreProcess(db).start()
        assert str(err.value).strip()
    finally:
        holder.close()


def test_it_closes_the_store_when_the_router_is_gone(tmp_path):
    db = tmp_path / "orphan.duckdb"
    store = StoreProcess(db).start()
    _record(store, 5)
    proc = store._proc
    assert proc is not None
    conn = store._conn
    assert conn is not None
    conn.close()  # what the kernel does to the pipe when the router is killed
    proc.join(30)
    assert proc.exitcode == 0
    assert verify_store(db).ok
