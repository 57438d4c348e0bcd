"""The symptoms read from the kind tables give what the ``events`` view gives, on stores and snapshots.

``coverage_gaps``, ``empty_after_abort``, ``shared_transfer_ids`` and ``unclean_ends`` read the few
kinds they need from their own tables when the store has them (binding the view of every kind costs
more than the query); a store without them (a lake's catalog) reads the view. Random histories, bounded
and unbounded windows, and a snapshot as of earlier batches must give the same answer both ways.
"""

from __future__ import annotations

import random

import pytest

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.layout import has_kind_tables
from kvtrail.audit.snapshot import live_snapshot
from kvtrail.audit.store import AuditStore
from kvtrail.audit.verify import unclean_ends
from kvtrail.forensics import Window
from kvtrail.forensics.questions import coverage_gaps
from kvtrail.forensics.symptoms import empty_after_abort, shared_transfer_ids
from tests.conftest import T0
from tests.forensics.test_replay import pd_request, pd_timeline


def _history(seed: int):
    rng = random.Random(seed)
    tl = pd_timeline()
    for name in ("p", "d", "router"):  # lifecycle: some instances close, some do not
        tl.add(name, "recorder_started", flush_interval_ns=rng.choice([10**6, 5 * 10**7]))
    for i in range(rng.randint(4, 12)):
        rid, tid = f"r{i}", rng.choice([i + 100, 100, 101])  # transfer ids sometimes shared
        page = 1 + i % 20
        pd_request(tl, rid, tid, [page], [page + 5], 10)
        if rng.random() < 0.5:
            tl.add(
                rng.choice(["p", "d"]),
                "request_aborted",
                rid,
                rng.choice([tid, None]),
                stage=rng.choice(["prefill_queue", "decode"]),
                abort_reason="cancelled",
                http_status=499,
            )
        tl.add(
            "router",
            "response_sent",
            rid,
            rng.choice([tid, tid + 1, None]),
            http_status=rng.choice([200, 200, 500]),
            prompt_tokens=10,
            completion_tokens=rng.choice([0, 0, 3]),
            latency_ns=10,
        )
        if rng.random() < 0.3:
            tl.add(
                rng.choice(["p", "d"]),
                "recorder_gap",
                dropped_events=rng.randint(1, 5),
                dropped_pages=0,
                gap_reason="buffer_full",
            )
        if rng.random() < 0.2:
            tl.seqs["d"] += rng.randint(1, 3)  # a sequence gap nobody reported
    restarted = rng.choice(["p", "d"])
    if rng.random() < 0.5:  # closed first (a clean end), or not: then its first instance ended uncleanly
        tl.add(restarted, "recorder_closed", dropped_events=0)
    if rng.random() < 0.7:
        tl.node(restarted, "prefill" if restarted == "p" else "decode", instance="i2")
        tl.add(restarted, "recorder_started", flush_interval_ns=10**6)
    return tl.events


def _answers(con, w: Window, kinds: bool) -> tuple:
    return (
        coverage_gaps(con, w, kinds=kinds).rows(),
        empty_after_abort(con, w, kinds=kinds).rows(),
        shared_transfer_ids(con, w, kinds=kinds).rows(),
        unclean_ends(con, kinds=kinds),
    )


@pytest.mark.parametrize("seed", range(12))
def test_the_kind_tables_answer_what_the_events_view_answers(seed):
    events = _history(seed)
    store = AuditStore(":memory:")
    try:
        cut = len(events) // 2
        for part in (events[:cut], events[cut:]):
            by_node: dict[tuple, list] = {}
            for e in part:
                by_node.setdefault((e["producer"]["node"], e["producer"]["instance"]), []).append(e)
            for batch in by_node.values():
                store.append(from_dicts(batch))
        con = store.con
        assert has_kind_tables(con)
        last = events[-1]["wall_ns"]
        windows = [
            Window(),
            Window(T0 + 20_000, None),
            Window(None, T0 + (last - T0) // 2),
            Window(T0 + 5_000, last - 5_000),
        ]
        for w in windows:
            assert _answers(con, w, True) == _answers(con, w, False), w
        assert any(_answers(con, Window(), True)), "a history with no symptom tests nothing"
        heads = [
            {"producer_id": p, "batch_no": 0} for (p,) in con.execute("SELECT producer_id FROM producers").fetchall()
        ]
        cur = store.cursor()
        with live_snapshot(cur, heads):
            assert has_kind_tables(cur)
            for w in windows:
                assert _answers(cur, w, True) == _answers(cur, w, False), w
        cur.close()
    finally:
        store.close()


def test_a_catalog_without_kind_tables_is_read_through_the_view():
    import duckdb

    con = duckdb.connect()
    con.execute("CREATE TABLE events_requests (request_no BIGINT)")
    assert not has_kind_tables(con)
