"""Prune removes old data except what a legal hold covers, records itself, and keeps the chain verifiable."""

import pytest

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.retention import add_hold, list_holds, prune, release_hold
from kvtrail.audit.verify import verify_store
from kvtrail.errors import StoreError
from tests.conftest import T0, alloc, config, delete_stored, event, producer

P, D = producer("prefill-0"), producer("decode-0", role="decode")
HOUR = 3600 * 10**9


@pytest.fixture
def aged(store):
    """Six one-event-pair batches per node, one per hour; tenant t0 in even hours, t1 in odd."""
    store.append(from_dicts([config(0, P, wall_ns=T0), config(0, D, wall_ns=T0)]))
    for h in range(6):
        w = T0 + h * HOUR + 1
        store.append(
            from_dicts(
                [
                    event(
                        1 + 2 * h,
                        "request_received",
                        P,
                        wall_ns=w,
                        request={"request_id": f"r{h}", "tenant_id": f"t{h % 2}"},
                        prompt_tokens=10,
                    ),
                    alloc(2 + 2 * h, [1 + h], rid=f"r{h}", tenant=None, prod=P, wall_ns=w + 5),
                    alloc(1 + h, [1 + h], rid=f"r{h}", tenant=None, prod=D, wall_ns=w + 7),
                ]
            )
        )
    return store


def _remaining_hours(store, node):
    rows = store.con.execute(
        "SELECT DISTINCT (wall_ns - ?) // ? FROM events_v WHERE node = ? AND kind <> 'node_config' ORDER BY 1",
        [T0, HOUR, node],
    ).fetchall()
    return [r[0] for r in rows]


def test_prune_removes_old_batches_and_chain_still_verifies(aged):
    res = prune(aged, T0 + 3 * HOUR, note="retention 90d")
    assert res.num_batches == 8 and res.prune_id == 1  # config + hours 0..2, both nodes
    assert _remaining_hours(aged, "prefill-0") == [3, 4, 5]
    report = verify_store(aged.con)
    assert report.ok and report.batches_pruned == 8
    cov = {c.node: c for c in report.coverage}
    assert cov["prefill-0"].pruned_events == 7 and cov["prefill-0"].unexplained == 0
    rec = aged.con.execute("SELECT num_batches, note FROM prunes").fetchone()
    assert rec == (8, "retention 90d")


def test_tenant_hold_keeps_that_tenants_batches_only(aged):
    add_hold(aged, T0, T0 + 6 * HOUR, "case 17", tenant_id="t1")
    res = prune(aged, T0 + 6 * HOUR)
    # Hours 1, 3, 5 on both nodes: decode's events carry only the request id, and the hold follows
    # the tenant's requests across nodes.
    assert res.num_held_batches == 6
    assert _remaining_hours(aged, "prefill-0") == [1, 3, 5]
    assert _remaining_hours(aged, "decode-0") == [1, 3, 5]
    assert verify_store(aged.con).ok


def test_node_hold_and_release(aged):
    hold = add_hold(aged, T0 + 2 * HOUR, T0 + 2 * HOUR + 100, "incident window", node="decode-0")
    prune(aged, T0 + 6 * HOUR)
    assert _remaining_hours(aged, "decode-0") == [2] and _remaining_hours(aged, "prefill-0") == []
    release_hold(aged, hold)
    res = prune(aged, T0 + 6 * HOUR)
    assert res.num_batches == 1 and res.prune_id == 2
    assert _remaining_hours(aged, "decode-0") == []
    assert verify_store(aged.con).ok
    assert list_holds(aged)[0].released_ns is not None


def test_dry_run_changes_nothing(aged):
    res = prune(aged, T0 + 6 * HOUR, dry_run=True)
    assert res.num_batches == 14 and res.prune_id is None
    assert aged.con.execute("SELECT count(*) FROM prunes").fetchone()[0] == 0
    assert len(_remaining_hours(aged, "prefill-0")) == 6


def test_tampering_with_the_prune_record_is_caught(aged):
    prune(aged, T0 + 3 * HOUR)
    aged.con.execute("UPDATE prunes SET before_ns = before_ns + 1")
    assert "prune record 1" in str(verify_store(aged.con).first_problem)


def test_pruning_rows_without_a_record_is_caught(aged):
    aged.con.execute("UPDATE batches SET pruned_by = 9 WHERE batch_no = 1")
    delete_stored(aged.con, "batch_no = 1", tables=("page_runs",))
    report = verify_store(aged.con)
    assert not report.ok and "no prune record" in str(report.first_problem)


def test_bad_hold_arguments(aged):
    with pytest.raises(StoreError, match="after"):
        add_hold(aged, T0 + 1, T0, "x")
    with pytest.raises(StoreError, match="no hold"):
        release_hold(aged, 42)
