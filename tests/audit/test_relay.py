"""Recorders in other processes reach the store through the relay: committed, chained, validated."""

import multiprocessing as mp

from kvtrail.audit.relay import RelayServer
from kvtrail.audit.store import AuditStore
from kvtrail.audit.verify import verify_store


def _worker(address, authkey, node, n):
    from kvtrail.audit.events import Producer, RequestRef
    from kvtrail.audit.recorder import Recorder
    from kvtrail.audit.relay import RelaySink

    rec = Recorder(RelaySink(address, authkey), Producer("c1", node, "decode", "kvtrail-reference", "0.1", node))
    rec.node_config(pool_tokens=64 * 16, pool_pages=64, page_size=16, context_tokens=4096)
    for i in range(n):
        rec.pages_allocated(RequestRef(f"{node}-r{i}", i, "acme"), [1 + i % 60, 2 + i % 60], "decode_reservation")
    rec.pages_allocated(RequestRef("bad"), [99], "decode_reservation")  # beyond the pool: rejected, counted
    assert rec.flush(30)
    stats = rec.stats()
    rec.close()
    assert stats["invalid_events_total"] == 1, stats
    assert stats["committed_events_total"] == n + 2, stats  # config + n + the gap event


def test_two_processes_record_into_one_store(tmp_path):
    store = AuditStore(tmp_path / "a.duckdb")
    server = RelayServer(store)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(server.address, server.authkey, f"decode-{k}", 500)) for k in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    try:
        assert [p.exitcode for p in procs] == [0, 0]
        rows = store.con.execute("SELECT node, count(*) FILTER (kind = 'pages_allocated'), "
                                 "count(*) FILTER (kind = 'recorder_gap') FROM events_v GROUP BY node ORDER BY node").fetchall()
        assert rows == [("decode-0", 500, 1), ("decode-1", 500, 1)]
        report = verify_store(store.con)
        assert report.ok and all(c.unexplained == 0 for c in report.coverage)
    finally:
        server.close()
        store.close()
