"""Recorders in other processes reach the store through the relay: committed, chained, validated.

Every reply path too: a batch the store refuses, bytes that are no batch, a failing store, a bad
authkey, a sender gone before its reply, and a relay that is gone. Real sockets on 127.0.0.1.
"""

import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Client

import pytest

from kvtrail.audit.batch import from_dicts, write_ipc
from kvtrail.audit.events import Producer, RequestRef
from kvtrail.audit.recorder import Recorder, RecorderConfig
from kvtrail.audit.relay import RelayServer, RelaySink
from kvtrail.audit.store import AuditStore
from kvtrail.audit.validate import producer_id
from kvtrail.audit.verify import verify_store
from kvtrail.errors import StoreError, ValidationError
from tests.conftest import alloc, config, producer


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
    assert stats["committed_events_total"] == n + 3, stats  # recorder_started + config + n + the gap


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
        rows = store.con.execute(
            "SELECT node, count(*) FILTER (kind = 'pages_allocated'), "
            "count(*) FILTER (kind = 'recorder_gap') FROM events_v "
            "GROUP BY node ORDER BY node"
        ).fetchall()
        assert rows == [("decode-0", 500, 1), ("decode-1", 500, 1)]
        report = verify_store(store.con)
        assert report.ok and all(c.unexplained == 0 for c in report.coverage)
    finally:
        server.close()
        store.close()


# ---- reply paths -------------------------------------------------------------------------------

P0, P1 = producer(node="prefill-0"), producer(node="prefill-1")


def _pid(prod: dict) -> int:
    return producer_id(Producer(**prod))


def _count(store) -> int:
    cur = store.cursor()  # the relay's committer thread owns store.con
    try:
        return cur.execute("SELECT count(*) FROM events").fetchone()[0]
    finally:
        cur.close()


@pytest.fixture
def relay(tmp_path):
    store = AuditStore(tmp_path / "a.duckdb")
    servers = []

    def start(**kw):
        servers.append(RelayServer(store, **kw))
        return servers[-1]

    yield store, start
    for s in servers:
        s.close()
    store.close()


def test_ok_reply_carries_the_commit(relay):
    store, start = relay
    server = start()
    sink = RelaySink(server.address, server.authkey)
    res = sink.append(from_dicts([config(0, P0), alloc(1, [1, 2, 3, 9], prod=P0)]))
    assert (res.num_events, res.num_page_events, res.num_runs) == (2, 4, 2)
    assert res.batches == ((_pid(P0), 0),)
    assert sink.append(from_dicts([alloc(2, [4], prod=P0)])).batches == ((_pid(P0), 1),)
    sink.close()


def test_refused_batch_gets_an_invalid_reply_and_nothing_is_stored(relay):
    store, start = relay
    server = start()
    sink = RelaySink(server.address, server.authkey)
    sink.append(from_dicts([config(0, P0)]))
    with pytest.raises(ValidationError) as err:
        sink.append(from_dicts([alloc(1, [1], prod=P0), alloc(2, [999], prod=P0), alloc(3, [998], prod=P0)]))
    assert (err.value.field, err.value.event, err.value.kind) == ("pages", 1, "pages_allocated")
    assert err.value.events == (1, 2)  # every event the rule refuses, for the writer to take out at once
    assert "out of pool" in err.value.reason
    assert _count(store) == 1  # neither event of the refused batch
    assert sink.append(from_dicts([alloc(1, [1], prod=P0)])).num_events == 1  # the connection still works
    sink.close()


def test_bytes_that_are_no_batch_get_an_invalid_reply_and_the_connection_survives(relay):
    store, start = relay
    server = start()
    conn = Client(server.address, authkey=server.authkey)
    conn.send_bytes(b"certainly not Arrow")
    kind, field, reason, event, _, events = conn.recv()
    assert (kind, field, event, events) == ("invalid", "(arrow)", None, ()) and "not a valid Arrow IPC stream" in reason
    conn.send_bytes(write_ipc(from_dicts([config(0, P0)])))
    assert conn.recv()[:3] == ("ok", 1, 0)
    conn.close()
    assert _count(store) == 1


def test_a_failing_store_gets_an_error_reply_naming_the_cause(relay):
    store, start = relay
    server = start()
    sink = RelaySink(server.address, server.authkey)
    sink.append(from_dicts([config(0, P0)]))
    store.con.close()  # the store fails after validation, when it writes
    with pytest.raises(StoreError, match="relay: store failed: ConnectionException"):
        sink.append(from_dicts([alloc(1, [1], prod=P0)]))
    sink.close()


def _send_together(sinks, tables):
    """Append one table per sink from its own thread, released at once; returns each outcome."""
    out: list = [None] * len(sinks)
    go = threading.Barrier(len(sinks))

    def send(i):
        go.wait()
        try:
            out[i] = sinks[i].append(tables[i])
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            out[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(sinks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_batches_arriving_together_share_a_commit_and_each_gets_its_reply(relay):
    store, start = relay
    server = start(coalesce_s=0.5)
    sinks = [RelaySink(server.address, server.authkey) for _ in range(2)]
    a, b = _send_together(sinks, [from_dicts([config(0, P0), alloc(1, [1, 2], prod=P0)]), from_dicts([config(0, P1)])])
    assert (a.num_events, a.num_page_events, a.batches) == (2, 2, ((_pid(P0), 0),))
    assert (b.num_events, b.num_page_events, b.batches) == (1, 0, ((_pid(P1), 0),))
    assert _count(store) == 3
    for s in sinks:
        s.close()


def test_a_refused_batch_among_coalesced_ones_is_refused_alone(relay):
    store, start = relay
    server = start(coalesce_s=0.5)
    sinks = [RelaySink(server.address, server.authkey) for _ in range(2)]
    good, bad = _send_together(
        sinks,
        [from_dicts([config(0, P0), alloc(1, [3], prod=P0)]), from_dicts([config(0, P1), alloc(1, [65], prod=P1)])],
    )
    assert good.num_events == 2 and good.batches == ((_pid(P0), 0),)
    assert isinstance(bad, ValidationError) and bad.field == "pages" and bad.event == 1
    assert _count(store) == 2
    for s in sinks:
        s.close()


def test_a_failing_store_fails_every_coalesced_sender(relay):
    store, start = relay
    server = start(coalesce_s=0.5)
    sinks = [RelaySink(server.address, server.authkey) for _ in range(2)]
    store.con.close()
    out = _send_together(sinks, [from_dicts([config(0, P0)]), from_dicts([config(0, P1)])])
    assert all(isinstance(e, StoreError) and "store failed" in str(e) for e in out), out
    for s in sinks:
        s.close()


def test_a_wrong_authkey_is_refused_and_the_relay_keeps_serving(relay):
    store, start = relay
    server = start()
    with pytest.raises(StoreError, match="refused the authkey"):
        RelaySink(server.address, b"not the key")
    sink = RelaySink(list(server.address), server.authkey)  # an address that went through JSON
    assert sink.append(from_dicts([config(0, P0)])).num_events == 1
    sink.close()


def test_a_sender_gone_before_its_reply_does_not_stop_the_relay(relay):
    store, start = relay
    server = start()
    conn = Client(server.address, authkey=server.authkey)
    conn.send_bytes(write_ipc(from_dicts([config(0, P0)])))
    conn.close()
    sink = RelaySink(server.address, server.authkey)
    assert sink.append(from_dicts([config(0, P1)])).num_events == 1
    deadline = time.monotonic() + 10
    while _count(store) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _count(store) == 2  # the gone sender's batch was committed all the same
    sink.close()


def test_a_sink_whose_relay_closed_raises_store_error(relay):
    store, start = relay
    server = start()
    sink = RelaySink(server.address, server.authkey)
    sink.append(from_dicts([config(0, P0)]))
    address = server.address
    server.close()
    with pytest.raises(StoreError, match="relay: connection lost"):
        sink.append(from_dicts([alloc(1, [1], prod=P0)]))
    sink.close()
    with pytest.raises(StoreError, match="relay: cannot connect"):
        RelaySink(address, server.authkey)


def _relay_process(path, conn):
    from kvtrail.audit.relay import RelayServer
    from kvtrail.audit.store import AuditStore

    server = RelayServer(AuditStore(path))
    conn.send((server.address, server.authkey))
    conn.recv()  # until killed


def test_a_recorder_whose_relay_process_died_counts_the_loss_and_never_raises(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtrail.audit.writer._RETRY_DELAYS_S", (0.0,))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_relay_process, args=(str(tmp_path / "a.duckdb"), child), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "relay process did not start"
        address, authkey = parent.recv()
        rec = Recorder(RelaySink(address, authkey), Producer(**P0), RecorderConfig(flush_interval_s=0.005))
        rec.node_config(pool_tokens=64 * 16, pool_pages=64, page_size=16, context_tokens=4096)
        assert rec.flush(30) and rec.stats()["committed_events_total"] == 2  # recorder_started, config
        proc.kill()
        proc.join(10)
        for i in range(5):
            rec.pages_allocated(RequestRef(f"r{i}"), [1 + i], "decode_growth")
        assert rec.flush(30)
        stats = rec.stats()
        assert stats["committed_events_total"] == 2 and stats["writer_errors_total"] >= 5
        rec.close()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
