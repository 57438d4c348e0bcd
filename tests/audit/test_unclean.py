"""A producer's end is recorded: recorder_started/recorder_closed frame every recorder instance, and an
instance that ended without recorder_closed (killed) is named by ``unclean_ends`` with its loss bound."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import jsonschema
import pytest

from kvtrail.audit.batch import from_dicts, to_dicts
from kvtrail.audit.buffer import EventBuffer
from kvtrail.audit.events import PAYLOAD_LAYOUT, Producer
from kvtrail.audit.recorder import Recorder, RecorderConfig
from kvtrail.audit.spec import shipped_schema
from kvtrail.audit.store import AuditStore, connect_readonly, read_events
from kvtrail.audit.verify import unclean_ends, verify_store
from kvtrail.errors import ValidationError
from tests.conftest import T0, alloc, config, event, producer, run_cli, stored_events

SECOND_NS = 10**9
PROD = Producer("c1", "decode-0", "decode", "kvtrail-reference", "0.1", "inst-1")


# ---- the recorder frames its instance ----------------------------------------------------------


def test_recorder_writes_started_first_and_closed_last(tmp_path):
    path = tmp_path / "a.duckdb"
    with Recorder(path, PROD, RecorderConfig(flush_interval_s=0.25)) as rec:
        rec.node_config(pool_tokens=1024, pool_pages=64, page_size=16, context_tokens=4096)
        assert rec.flush(10)
    evs = stored_events(path)
    assert [e["kind"] for e in evs] == ["recorder_started", "node_config", "recorder_closed"]
    assert [e["seq"] for e in evs] == [0, 1, 2]
    assert evs[0]["flush_interval_ns"] == 250_000_000
    assert evs[2]["dropped_events"] == 0 and "request" not in evs[2]
    assert verify_store(path).unclean_ends == []


def test_an_idle_recorder_writes_nothing_until_it_closes(tmp_path):
    path = tmp_path / "a.duckdb"
    rec = Recorder(path, PROD, RecorderConfig(flush_interval_s=0.005))
    assert rec.flush(10) and rec.stats()["committed_events_total"] == 0
    rec.close()
    assert [e["kind"] for e in stored_events(path)] == ["recorder_started", "recorder_closed"]


def test_buffer_closes_after_its_gaps_and_counts_the_drops():
    buf = EventBuffer(2)
    buf.begin(7)
    for _ in range(3):
        buf.put(1, None, None, None, (1, None))  # the third is dropped
    buf.end()
    items, _ = buf.drain([])
    kinds = [it[0] for it in items]
    seqs = [it[1] for it in items]
    from kvtrail.audit.events import KIND_CODES

    assert kinds == [KIND_CODES["recorder_started"], 1, 1, KIND_CODES["recorder_gap"], KIND_CODES["recorder_closed"]]
    assert seqs == [0, 1, 2, 4, 5]  # seq 3 is the dropped event, counted by the gap
    assert dict(zip(PAYLOAD_LAYOUT["recorder_started"], items[0][6])) == {"flush_interval_ns": 7}
    assert dict(zip(PAYLOAD_LAYOUT["recorder_closed"], items[-1][6])) == {"dropped_events": 1}
    assert buf.drain([]) == ([], [])  # closed once


# ---- the event model -----------------------------------------------------------------------------


def test_lifecycle_kinds_are_valid_events_and_need_their_fields(store):
    evs = [
        event(0, "recorder_started", flush_interval_ns=SECOND_NS),
        config(1),
        event(2, "recorder_closed", dropped_events=4),
    ]
    store.append(from_dicts(evs))
    assert to_dicts(read_events(store.con)) == evs
    for e in evs:
        jsonschema.validate(e, shipped_schema())
    bad = event(3, "recorder_started")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, shipped_schema())
    with pytest.raises(ValidationError, match="flush_interval_ns"):
        store.append(from_dicts([bad]))
    with pytest.raises(ValidationError, match="flush_interval_ns"):
        store.append(from_dicts([event(3, "recorder_started", flush_interval_ns=0)]))


# ---- unclean_ends on hand-built stores -------------------------------------------------------------


def _instance(name, t0, n=3, closed=False, started=True, node="decode-0", bound_ns=SECOND_NS):
    """Events of one instance of ``node``: started, config, ``n`` allocations from ``t0`` (1 ms apart)."""
    prod = producer(node=node, role="decode", instance=name)
    evs = [event(0, "recorder_started", prod, wall_ns=t0, flush_interval_ns=bound_ns)] if started else []
    evs.append(config(len(evs), prod))
    evs[-1]["wall_ns"] = t0
    for i in range(n):
        seq = len(evs)
        evs.append(alloc(seq, [1 + i], prod=prod))
        evs[-1]["wall_ns"] = t0 + (i + 1) * 10**6
    if closed:
        evs.append(event(len(evs), "recorder_closed", prod, wall_ns=t0 + (n + 1) * 10**6))
    return evs


def _ensure_opens_table(con) -> None:
    # The store's owner records its writable opens there; create it where this store has none yet.
    con.execute("CREATE TABLE IF NOT EXISTS store_opens (open_no BIGINT, opened_ns BIGINT, kvtrail_version VARCHAR)")


def _record_open(con, opened_ns: int) -> None:
    _ensure_opens_table(con)
    n = con.execute("SELECT coalesce(max(open_no), 0) + 1 FROM store_opens").fetchone()[0]
    con.execute("INSERT INTO store_opens VALUES (?, ?, 'test')", [n, opened_ns])


def test_a_later_instance_of_the_node_makes_an_unclosed_one_unclean(store):
    store.append(from_dicts(_instance("i1", T0)))
    store.append(from_dicts(_instance("i2", T0 + 60 * SECOND_NS)))
    (end,) = unclean_ends(store.con)
    assert (end.node, end.instance, end.cluster, end.last_seq, end.last_wall_ns, end.bound_ns) == (
        "decode-0",
        "i1",
        "c1",
        4,
        T0 + 3 * 10**6,
        SECOND_NS,
    )
    assert end.ended_by_ns == T0 + 60 * SECOND_NS and end.gap_end_ns == T0 + 3 * 10**6 + SECOND_NS
    assert "later instance i2" in end.reason
    line = str(end)
    assert line.startswith(f"decode-0 producer {end.producer_id} (instance i1): unclean end after seq 4 at 2026-09-09T")
    assert "events up to 1 s after it may be lost" in line
    report = verify_store(store.con)
    assert report.ok and report.unclean_ends == [end]


def test_closed_open_and_unannounced_instances_are_not_unclean(store):
    store.append(from_dicts(_instance("closed", T0, closed=True)))
    store.append(from_dicts(_instance("old-style", T0, started=False, node="prefill-0")))
    store.append(from_dicts(_instance("running", T0 + 10 * SECOND_NS)))
    store.append(from_dicts(_instance("later", T0 + 20 * SECOND_NS, node="prefill-0")))
    # "closed" ended cleanly; "old-style" records no lifecycle (cannot be judged); the newest instances
    # of each node are open (running, or stopped and not known yet).
    assert unclean_ends(store.con) == []


def test_a_reopened_store_makes_every_unclosed_instance_unclean(store):
    store.append(from_dicts(_instance("i1", T0, bound_ns=SECOND_NS // 2)))
    store.append(from_dicts(_instance("r1", T0, node="router-0", closed=True)))
    assert unclean_ends(store.con) == []
    reopened_ns = time.time_ns() + 1000  # the owner's clock, after the commits (events may be older: ingest)
    _record_open(store.con, reopened_ns)
    (end,) = unclean_ends(store.con)
    assert end.instance == "i1" and end.bound_ns == SECOND_NS // 2 and end.ended_by_ns == reopened_ns
    assert end.reason.startswith("the store's owner restarted at 20")
    assert "events up to 0.5 s after it may be lost" in str(end)


def test_an_open_before_the_last_commit_is_not_an_end(store):
    _record_open(store.con, time.time_ns())  # the open this instance was committed under
    store.append(from_dicts(_instance("i1", T0)))
    assert unclean_ends(store.con) == []


# ---- a killed store owner --------------------------------------------------------------------------

_CHILD = """
import sys, time
from kvtrail.audit.events import Producer, RequestRef
from kvtrail.audit.recorder import Recorder, RecorderConfig
rec = Recorder(sys.argv[1], Producer("c1", "router-0", "router", "kvtrail-reference", "0.1", "killed"),
               RecorderConfig(flush_interval_s=0.5))
rec.node_config(pool_tokens=1024, pool_pages=64, page_size=16, context_tokens=4096)
assert rec.flush(30)
i = 0
while True:
    rec.request_received(RequestRef(f"r{i}", i, "acme"), 10)
    i += 1
    if i % 20 == 0:
        print(i, flush=True)  # numbered so far: seq 0..i+1 (recorder_started, node_config, i requests)
    time.sleep(0.005)
"""


def test_a_killed_store_owner_leaves_an_unclean_end_with_its_bound(tmp_path):
    path = tmp_path / "a.duckdb"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        recorded = 0
        deadline = time.monotonic() + 60
        while recorded < 200:  # ~1 s of traffic: at least one flush committed, the newest still in memory
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "recorder process stopped early"
            recorded = int(line)
        killed_ns = time.time_ns()
        proc.kill()  # only our own child, by its handle
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    with AuditStore(path) as s:  # the owner restarted
        stored = s.con.execute("SELECT max(seq) FROM events").fetchone()[0]
        assert stored < recorded + 1, "nothing was lost: the test did not exercise a lost tail"
        kinds = {k for (k,) in s.con.execute("SELECT DISTINCT kind FROM events").fetchall()}
        assert "recorder_started" in kinds and "recorder_closed" not in kinds
        if (
            not s.con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'store_opens'").fetchone()[0]
            or not s.con.execute("SELECT count(*) FROM store_opens WHERE opened_ns > ?", [killed_ns]).fetchone()[0]
        ):
            _record_open(s.con, time.time_ns())
        (end,) = unclean_ends(s.con)
        assert (end.node, end.instance, end.last_seq, end.bound_ns) == ("router-0", "killed", stored, SECOND_NS // 2)
        assert "store's owner restarted" in end.reason
        # What is stored ends within the bound (plus a commit's time) before the kill.
        assert killed_ns - end.last_wall_ns < SECOND_NS // 2 + SECOND_NS


def _commits(path, producer_id: int) -> list[tuple[int, int]]:
    con = connect_readonly(path)
    try:
        return con.execute(
            "SELECT committed_ns, max_wall_ns FROM batches WHERE producer_id = ?", [producer_id]
        ).fetchall()
    finally:
        con.close()


def test_read_only_verify_of_a_crashed_store_copy_reports_its_unclean_end(tmp_path, capsys):
    # the probe: a store whose owner was killed, copied (main file and WAL), verified without any writer
    # opening it first
    path = tmp_path / "a.duckdb"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while True:
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "recorder process stopped early"
            if int(line) >= 100:
                break
        proc.kill()  # only our own child, by its handle
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    copy = tmp_path / "copy.duckdb"
    shutil.copyfile(path, copy)
    if path.with_name(path.name + ".wal").exists():
        shutil.copyfile(path.with_name(path.name + ".wal"), copy.with_name(copy.name + ".wal"))
    rc, out, err = run_cli(capsys, "audit", "verify", "--db", str(copy), "--json")
    assert rc == 0, err  # a coverage gap, not a broken chain
    doc = json.loads("\n".join(out))
    [end] = doc["unclean_ends"]
    assert (end["node"], end["instance"], end["bound_ns"]) == ("router-0", "killed", SECOND_NS // 2)
    # the flush interval plus the slowest commit the store saw of it (from a batch's newest event to its commit)
    delay = max(0, max(c - w for c, w in _commits(copy, end["producer_id"])))
    assert end["commit_delay_ns"] == delay
    assert "store is at rest" in end["reason"] and end["gap_end_ns"] == end["last_wall_ns"] + SECOND_NS // 2 + delay
    rc, out, _ = run_cli(capsys, "audit", "verify", "--db", str(copy))
    assert rc == 0 and any("unclean end after seq" in line and "killed" in line for line in out), out
    # nothing wrote to the copy: the read-only check found the end on its own
    con = connect_readonly(copy)
    try:
        assert con.execute("SELECT count(*) FROM store_opens").fetchone()[0] == 1  # the killed owner's open only
    finally:
        con.close()


def test_a_store_its_owner_holds_does_not_report_a_running_instance(store):
    store.append(from_dicts(_instance("running", T0)))
    assert verify_store(store.con).unclean_ends == []  # the owner's own connection: the instance may still run
