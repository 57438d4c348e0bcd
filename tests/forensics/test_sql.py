"""The SQL engine agrees with the replay engine, finding for finding, on the codes it implements."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore, connect_readonly
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.forensics.sql import engine as sql_engine
from kvtrail.forensics.sql.engine import sql_findings
from tests.conftest import T0
from tests.forensics import test_replay
from tests.forensics.test_replay import ACTIONS, POOL, Oracle, Timeline, pd_request, pd_timeline


def _key(f):
    return (f.code, f.node, f.request_id, f.pages, f.evidence)


def compare(store, from_ns=None, to_ns=None, policy=ForensicsPolicy()):
    """Assert both engines report the same findings, field for field; return the SQL engine's."""
    got = sql_findings(store.con, from_ns, to_ns, policy)
    want = replay_store(store.con, from_ns, to_ns, policy)
    assert sorted(map(_key, got), key=repr) == sorted(map(_key, want), key=repr)
    full = {_key(f): f for f in want}
    for f in got:  # and the rest of the finding as well
        w = full[_key(f)]
        assert (
            f.tenant_id,
            f.victim_request_ids,
            f.victim_tenant_ids,
            f.first_ns,
            f.last_ns,
            f.severity,
            f.lineage_checked,
            f.lineage_matched,
        ) == (
            w.tenant_id,
            w.victim_request_ids,
            w.victim_tenant_ids,
            w.first_ns,
            w.last_ns,
            w.severity,
            w.lineage_checked,
            w.lineage_matched,
        ), f
    return got


def stored(store, tl):
    store.append(from_dicts(tl.events))
    return store


def history_f5_f6_f7():
    tl = Timeline()
    tl.node("d")
    tl.alloc("d", "r1", [1, 2, 3, 4])
    tl.write("d", "r1", [1, 2, 3, 4])
    tl.alloc("d", "r3", [1], "prefix_hit", block_hashes=[9])
    tl.alloc("d", "r2", [4, 5, 6])  # F6 on 4 (held by r1)
    tl.free("d", "r1", [1, 2, 3, 4], "abort")
    tl.read("d", "r1", [2, 3, 7])  # F5: released and never held
    tl.alloc("d", "r4", [2, 3], "decode_reservation")
    tl.write("d", "r1", [3])  # F7 late write, victim r4
    tl.write("d", "r5", [9])  # F7 on a page never held
    tl.read("d", "r3", [1])  # prefix hit: held, no finding
    tl.add("d", "pages_freed", None, pages=[1], free_reason="eviction")  # radix eviction drops r3
    tl.read("d", "r3", [1])  # F5
    tl.alloc("d", "r6", [4])  # F6 on 4: r2 still holds it
    tl.read("d", "r2", [4, 5, 6])  # held: no F5
    return tl


def test_hand_built_page_findings(mem_store):
    got = compare(stored(mem_store, history_f5_f6_f7()))
    codes = [f.code for f in got if f.code != "F1"]
    assert codes.count("F5") == 2 and codes.count("F6") == 2 and codes.count("F7") == 2
    f7 = [f for f in got if f.code == "F7"]
    assert [(f.request_id, f.pages, f.victim_request_ids) for f in f7] == [("r1", (3,), ("r4",)), ("r5", (9,), ())]
    assert "released" in f7[0].detail and "never held" in f7[1].detail
    assert {f.request_id for f in got if f.code == "F1"} == {"r1", "r2", "r3"}
    f5 = [f for f in got if f.code == "F5"]
    assert f5[0].pages == (2, 3, 7)


def test_promoted_owner_keeps_the_first_allocation_as_evidence(mem_store):
    tl = Timeline()
    tl.node("d")
    a1 = tl.alloc("d", "r1", [1])
    tl.alloc("d", "r2", [1])  # F6, r2 becomes a further holder
    tl.free("d", "r1", [1])  # r2 is promoted; the recorded allocation stays r1's
    a3 = tl.alloc("d", "r3", [1])
    got = compare(stored(mem_store, tl))
    assert [s for _, s in got[-1].evidence] == [a1["seq"], a3["seq"]] and got[-1].victim_request_ids == ("r2",)


def test_pd_transfer_abort_and_config_findings(mem_store):
    tl = pd_timeline()
    tl.node("p2", "prefill", pool_pages=8, page_size=16, context_tokens=1024)  # F8
    pd_request(tl, "r1", 42, [1], list(range(1, 9)), 120, sent_tokens=1, sent_pages=1)  # F2
    pd_request(tl, "r2", 43, [2, 3], [10, 11], 20, received_tokens=12)  # F2
    pd_request(tl, "r3", 44, [4], [12], 10)  # clean
    tl.add("d", "transfer_reserved", "r4", 5, pages=[20, 21], num_tokens=20)
    tl.add("d", "transfer_received", "r4", 5, pages=[], num_tokens=0, status="failed")  # F2 (nothing landed)
    tl.add("p", "request_aborted", "r5", 77, stage="prefill_queue", abort_reason="input too long", http_status=400)
    tl.add(
        "router", "response_sent", "r5", 77, http_status=200, prompt_tokens=9, completion_tokens=5, latency_ns=10
    )  # F4
    tl.add(
        "router", "response_sent", "router-r5", 77, http_status=200, prompt_tokens=9, completion_tokens=5, latency_ns=10
    )  # not F4: another request id (a collision)
    tl.add("d", "request_aborted", "r6", stage="decode", abort_reason="client", http_status=499)
    tl.add("router", "response_sent", "r6", http_status=499, prompt_tokens=1, completion_tokens=0, latency_ns=1)
    tl.add("router", "response_sent", "r6", http_status=200, prompt_tokens=1, completion_tokens=1, latency_ns=1)
    got = compare(stored(mem_store, tl))
    assert sorted(f.code for f in got) == ["F1", "F2", "F2", "F2", "F4", "F4", "F8"]


def test_restart_and_windows(mem_store):
    tl = pd_timeline()
    pd_request(tl, "r1", 42, [1], list(range(1, 9)), 120, sent_tokens=1, sent_pages=1)
    tl.free("d", "r1", list(range(1, 9)), "finish")
    mid = T0 + 1000 * len(tl.events)
    tl.alloc("d", "r2", [1, 2])
    tl.free("d", "r2", [1, 2], "abort")
    tl.alloc("d", "r3", [1, 2])
    tl.write("d", "r2", [1])  # late write
    tl.alloc("d", "r7", [2])  # double ownership
    tl.node("d", instance="i2")  # restart: a fresh pool, nobody holds anything
    tl.alloc("d", "r4", [1])
    tl.read("d", "r3", [2])  # F5 after the restart
    end = T0 + 1000 * len(tl.events)
    tl.add("router", "response_sent", "r1", 42, http_status=200, prompt_tokens=120, completion_tokens=3, latency_ns=9)
    stored(mem_store, tl)
    assert {f.code for f in compare(mem_store)} == {"F1", "F2", "F5", "F6", "F7"}
    for lo, hi in [(mid, end), (None, mid), (mid, None), (mid + 3000, end - 2000), (end, None)]:
        compare(mem_store, lo, hi)


def _temporary_tables(con) -> list[str]:
    return [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() WHERE temporary").fetchall()]


def test_the_engine_leaves_nothing_on_the_callers_connection(mem_store, monkeypatch, tmp_path):
    """The relations every question shares are the call's own temporary tables: gone when it returns or
    fails, the connection out of its transaction, a read-only store read the same way."""
    stored(mem_store, history_f5_f6_f7())
    con = mem_store.con
    first = compare(mem_store)
    assert first and _temporary_tables(con) == []
    assert compare(mem_store) == first  # a second call on the same connection asks the same
    con.begin()  # no transaction left open
    con.rollback()

    def broken(ctx):
        assert len(_temporary_tables(ctx.con)) == 3  # what the failure below has to clean up
        raise RuntimeError("a query failed half way")

    with monkeypatch.context() as m:
        m.setattr(sql_engine, "f6", broken)
        with pytest.raises(RuntimeError, match="half way"):
            sql_findings(con)
    assert _temporary_tables(con) == []
    assert [f.code for f in sql_findings(con)] == [f.code for f in first]

    with AuditStore(str(tmp_path / "s.duckdb")) as store:
        stored(store, history_f5_f6_f7())
    with connect_readonly(str(tmp_path / "s.duckdb")) as ro:
        assert [f.code for f in sql_findings(ro)] == [f.code for f in first]
        assert _temporary_tables(ro) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_property_sql_matches_replay(data):
    tl = Timeline()
    tl.node("d", pool_pages=POOL)
    oracle = Oracle(tl)
    for action in data.draw(st.lists(st.sampled_from(ACTIONS), max_size=30)):
        oracle.step(action, data)
    with AuditStore(":memory:") as store:
        store.append(from_dicts(tl.events))
        compare(store)
        lo = data.draw(st.integers(0, len(tl.events)))
        compare(store, T0 + 1000 * lo, T0 + 1000 * data.draw(st.integers(lo, len(tl.events))))


HAND_BUILT = [
    name
    for name in dir(test_replay)
    if name.startswith("test_")
    and "property" not in name
    and name not in ("test_store_round_trip_and_window", "test_findings_table")
]


@pytest.mark.parametrize("name", HAND_BUILT)
def test_sql_agrees_on_every_hand_built_replay_history(name, monkeypatch):
    """Each hand-built history of the replay tests, stored, gives the same findings in SQL."""
    replay_only = Timeline.findings
    compared = []

    def both(self):
        with AuditStore(":memory:") as store:
            store.append(from_dicts(self.events))
            compared.append(len(compare(store)))
        return replay_only(self)

    monkeypatch.setattr(Timeline, "findings", both)
    getattr(test_replay, name)()
    assert compared  # the history was compared (compare() asserts the agreement)
