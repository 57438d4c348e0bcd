"""Per-minute aggregates: batch-by-batch updates (as the live judge gets commits) equal a recompute, and a
window's counts equal a scan of its events whatever the aggregates cover."""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pytest

from kvtrail import forensics as fx
from kvtrail.audit.retention import prune
from kvtrail.audit.store import AuditStore, read_events
from kvtrail.cli import main
from kvtrail.forensics.online import OnlineReplay
from kvtrail.forensics.results import aggregates as ag
from kvtrail.forensics.results.aggregates import uncovered_minutes
from kvtrail.forensics.results.persist import save_findings
from kvtrail.forensics.results.window_counts import WindowCounts, window_counts

SIM = [
    "--seed",
    "11",
    "--nodes",
    "2",
    "--hours",
    "0.05",
    "--rate",
    "2",
    "--plants-per-hour",
    "60",
    "--tenants",
    "4",
    "--prefill-pool-tokens",
    "200000",
    "--decode-pool-tokens",
    "600000",
    "--context-tokens",
    "400000",
]
PARTS = 4


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    db = tmp_path_factory.mktemp("agg") / "sim.duckdb"
    assert main(["simulate", "--db", str(db), *SIM]) == 0
    return db


def parts(db: Path) -> list[pa.Table]:
    """The store's events as PARTS appends: every producer's events cut in seq order, the i-th piece of each
    producer in the i-th append (so one append commits a batch of several producers, like the service's)."""
    with duckdb.connect(str(db), read_only=True) as con:
        events = read_events(con)
    frame = pl.from_arrow(events.select(["cluster", "node", "instance"]))
    assert isinstance(frame, pl.DataFrame)
    keys = frame.with_row_index("i")
    out: list[list[int]] = [[] for _ in range(PARTS)]
    for _, g in keys.group_by(["cluster", "node", "instance"], maintain_order=True):
        rows = g["i"].to_list()
        for k in range(PARTS):
            out[k] += rows[k * len(rows) // PARTS : (k + 1) * len(rows) // PARTS]
    assert sum(map(len, out)) == events.num_rows
    return [events.take(pa.array(sorted(rows))) for rows in out]


def snapshot(con: duckdb.DuckDBPyConnection) -> list[tuple]:
    return con.execute(
        f"SELECT producer_id, minute_ns, {', '.join(ag.COUNTER_NAMES)} FROM minute_events "
        "WHERE events > 0 ORDER BY 1, 2"
    ).fetchall()


def findings_counts(con: duckdb.DuckDBPyConnection) -> dict[tuple, int]:
    return {
        tuple(r[:4]): r[4]
        for r in con.execute(
            "SELECT node, minute_ns, code, severity, sum(findings) FROM minute_findings GROUP BY ALL"
        ).fetchall()
    }


def scan(con: duckdb.DuckDBPyConnection, lo: int, hi: int) -> dict[str, dict[str, int]]:
    """A few counters of [lo, hi] per node, computed from the events without the aggregates module."""
    rows = con.execute(
        """
        SELECT node || '/' || instance, count(*), sum(num_pages + num_dst_pages), count(*) FILTER (kind = 'kv_read'),
               count(*) FILTER (kind = 'transfer_received'), count(*) FILTER (kind = 'response_sent'
               AND http_status = 200), coalesce(sum(dropped_events), 0), max(wall_ns)
        FROM events_v WHERE wall_ns BETWEEN ? AND ? GROUP BY 1""",
        [lo, hi],
    ).fetchall()
    names = (
        "events",
        "page_events",
        "reads",
        "transfers_received",
        "responses_2xx",
        "recorder_dropped_events",
        "last_event_ns",
    )
    return {r[0]: dict(zip(names, map(int, r[1:]))) for r in rows}


def counted(wc: WindowCounts) -> dict[str, dict[str, int]]:
    names = (
        "events",
        "page_events",
        "reads",
        "transfers_received",
        "responses_2xx",
        "recorder_dropped_events",
        "last_event_ns",
    )
    return {
        f"{r['node']}/{r['instance']}": {n: r[n] for n in names} for r in wc.events.iter_rows(named=True) if r["events"]
    }


def test_batches_added_as_committed_equal_a_recompute(source, tmp_path):
    with AuditStore(tmp_path / "live.duckdb") as store:
        con, judge = store.cursor(), OnlineReplay()
        for table in parts(source):
            res = store.append(table)
            assert len(res.batches) > 1 and res.table is not None  # several producers in one commit
            # what the live judge does after each commit: feed, poll, save without a recompute, add the batch
            assert judge.feed_committed(con, res.table, dict(res.batches))
            save_findings(con, judge.poll(con), from_ns=None, to_ns=None, engine="online", recompute_aggregates=False)
            ag.add_batch(con, res.table, dict(res.batches))
            assert uncovered_minutes(con, 0, 2**62) == []
        incremental, found = snapshot(con), findings_counts(con)
        assert sum(r[2] for r in incremental) == con.execute("SELECT count(*) FROM events").fetchall()[0][0]
        assert found and sum(found.values()) == con.execute("SELECT count(*) FROM findings").fetchall()[0][0]
        ag.recompute(con, None, None)  # what a --save run does
        assert snapshot(con) == incremental and findings_counts(con) == found
        ag.add_batch(con, res.table, res.batches)  # already counted by the recompute: not counted twice
        assert snapshot(con) == incremental


def test_commits_added_together_equal_them_added_one_by_one(source, tmp_path):
    """What one judge poll hands over at once: several commits, several batches of each producer."""
    pieces = [
        t for table in parts(source) for t in (table.slice(0, table.num_rows // 2), table.slice(table.num_rows // 2))
    ]
    shots = []
    for together in (False, True):
        with AuditStore(tmp_path / f"together-{together}.duckdb") as store:
            con = store.cursor()
            held = []
            for k, table in enumerate(pieces):
                res = store.append(table)
                held.append((res.table, dict(res.batches)))
                if k % 3 == 2 or k == len(pieces) - 1:  # a poll every third commit
                    if together:
                        ag.add_batches(con, held)
                    else:
                        for t, b in held:
                            ag.add_batch(con, t, b)
                    held = []
            assert uncovered_minutes(con, 0, 2**62) == []
            shots.append((snapshot(con), con.execute("SELECT * FROM minute_coverage ORDER BY 1").fetchall()))
            ag.recompute(con, None, None)
            assert snapshot(con) == shots[-1][0]
    assert shots[0][0] == shots[1][0] and len(shots[0][1]) == len(shots[1][1])
    assert sum(r[2] for r in shots[1][0]) == sum(t.num_rows for t in pieces)


def test_commits_added_together_skip_one_not_handed(source, tmp_path):
    with AuditStore(tmp_path / "skip.duckdb") as store:
        con = store.cursor()
        first, second, third, fourth = parts(source)
        ag.add_batches(con, [_commit(store, first)])
        store.append(second)  # never handed
        ag.add_batches(con, [_commit(store, third), _commit(store, fourth)])
        holes = uncovered_minutes(con, 0, 2**62)
        assert holes
        lo, hi = con.execute("SELECT min(min_wall_ns), max(max_wall_ns) FROM batches").fetchall()[0]
        assert counted(window_counts(con, lo, hi)) == scan(con, lo, hi)


def test_a_batch_not_added_uncovers_its_minutes_until_a_recompute(source, tmp_path):
    with AuditStore(tmp_path / "gap.duckdb") as store:
        con = store.cursor()
        first, second, third, fourth = parts(source)
        ag.add_batch(con, *_commit(store, first))
        store.append(second)  # committed, never handed to add_batch (judge fell behind)
        ag.add_batch(con, *_commit(store, third))
        holes = uncovered_minutes(con, 0, 2**62)
        assert holes
        lo, hi = con.execute("SELECT min(min_wall_ns), max(max_wall_ns) FROM batches").fetchall()[0]
        wc = window_counts(con, lo, hi)
        assert wc.answered_minutes < wc.minutes and counted(wc) == scan(con, lo, hi)
        ag.add_batch(con, *_commit(store, fourth))
        assert set(uncovered_minutes(con, 0, 2**62)) >= set(holes)  # still unknown: not claimed
        assert ag.refresh(con) >= len(holes)  # what a judge that read batches back runs: only those minutes
        assert uncovered_minutes(con, 0, 2**62) == []
        refreshed = snapshot(con)
        ag.recompute(con, None, None)
        assert snapshot(con) == refreshed


def _commit(store: AuditStore, table: pa.Table) -> tuple[pa.Table, tuple]:
    res = store.append(table)
    assert res.table is not None
    return res.table, res.batches


@pytest.mark.parametrize("cut", [0, 1, 2])
def test_window_counts_equal_a_scan_of_the_window(source, tmp_path, cut):
    db = tmp_path / "w.duckdb"
    db.write_bytes(source.read_bytes())
    with duckdb.connect(str(db)) as con:
        lo, hi = con.execute("SELECT min(min_wall_ns), max(max_wall_ns) FROM batches").fetchall()[0]
        windows = [(lo, hi), (lo + 12_345_678_901, hi - 7_654_321), (lo + 61 * 10**9, lo + 61 * 10**9 + 5)]
        if cut == 1:
            ag.recompute(con, lo, lo + (hi - lo) // 2)  # half the store covered
        elif cut == 2:
            ag.recompute(con, None, None)
        for a, b in windows:
            wc = window_counts(con, a, b)
            assert counted(wc) == scan(con, a, b), (a, b)
            if wc.minutes:  # the last window holds no whole minute: read from the events whatever is built
                assert (wc.answered_minutes == wc.minutes) == (cut == 2)
            else:
                assert wc.scanned == ((a, b + 1),)
        every = window_counts(con, None, None)
        assert counted(every) == scan(con, 0, 2**63 - 1)


def test_save_findings_keeps_findings_counts_and_a_prune_uncovers(source, tmp_path):
    db = tmp_path / "s.duckdb"
    db.write_bytes(source.read_bytes())
    found = list(fx.ask_findings(db).found)
    assert found
    with duckdb.connect(str(db)) as con:
        save_findings(con, found, from_ns=None, to_ns=None, engine="replay")
        by_code = dict(con.execute("SELECT code, count(*) FROM findings GROUP BY 1").fetchall())
        assert dict(con.execute("SELECT code, sum(findings) FROM minute_findings GROUP BY 1").fetchall()) == by_code
        assert uncovered_minutes(con, 0, 2**62) == []
        before = snapshot(con)
        save_findings(con, found[:3], from_ns=None, to_ns=None, engine="online", recompute_aggregates=False)
        assert snapshot(con) == before  # the event counters are the caller's (add_batch)
        assert dict(con.execute("SELECT code, sum(findings) FROM minute_findings GROUP BY 1").fetchall()) == by_code
        wc = window_counts(con, None, None)
        shown = wc.findings.group_by("code").agg(pl.col("findings").sum())
        assert dict(shown.iter_rows()) == by_code
    with AuditStore(db) as store:
        lo = store.con.execute("SELECT min(max_wall_ns) FROM batches").fetchall()[0][0]
        assert prune(store, lo + 1).prune_id is not None
        con = store.cursor()
        assert uncovered_minutes(con, 0, 2**62)  # the pruned batches' minutes changed since they were counted
        wc = window_counts(con, None, None)
        assert counted(wc) == scan(con, 0, 2**63 - 1)
