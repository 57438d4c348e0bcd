"""The live judge: findings of a planted incident are persisted as its batches arrive; its failures never
fail ingest and are retried."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from kvtrail.forensics import replay_store
from kvtrail.forensics.results.persist import finding_id, stored_findings
from kvtrail.sim.fleet.config import FleetConfig
from kvtrail.sim.fleet.run import fleet_batches
from tests.service.conftest import arrow_body, auth

# A seconds-long fleet with one double allocation and one late write planted (plus the incident's F8).
FLEET = FleetConfig(
    hours=0.001,
    seed=1,
    rate_per_s=10,
    prefill_nodes=2,
    decode_nodes=2,
    tenants=6,
    chunk_tokens=4096,
    prefill_pool_tokens=16_384,
    decode_pool_tokens=69_632,
    context_tokens=65_536,
    prefill_rate_min_tokens_per_s=40_000,
    prompt_median_tokens=1024,
    prompt_sigma=1.5,
    completion_median_tokens=48,
    max_new_tokens=1024,
    doc_median_tokens=512,
    plants_per_hour=1500,
)


@pytest.fixture(scope="module")
def fleet():
    truth: dict = {}
    tables = list(fleet_batches(FLEET, truth))
    return tables, truth


def _persisted(state) -> list[dict]:
    cur = state.cursor()
    try:
        return stored_findings(cur).to_pylist()
    finally:
        cur.close()


def test_findings_of_a_planted_incident_are_persisted_as_batches_arrive(client, service_state, producer_token, fleet):
    tables, truth = fleet
    assert truth["summary"]["plants"] == {"double_alloc": 1, "late_write": 1}
    for table in tables:
        r = client.post("/v1/events", content=arrow_body(table), headers=auth(producer_token))
        assert r.status_code == 200, r.text
    assert service_state.judge.wait_idle(60)
    rows = _persisted(service_state)
    cur = service_state.cursor()
    expected = replay_store(cur)  # the authoritative window re-run over the same store
    cur.close()
    assert Counter(r["code"] for r in rows) == Counter(f.code for f in expected)
    assert {r["finding_id"] for r in rows} == {finding_id(f) for f in expected}
    assert {"F1", "F6", "F7"} <= {r["code"] for r in rows}  # the planted page bugs
    stats = service_state.judge.stats()
    assert stats["failures"] == 0 and stats["events_judged"] == sum(t.num_rows for t in tables)
    assert service_state.judge.last_run_id == max(r["first_run_id"] for r in rows)
    assert stats["lag_p99_s"] is not None and stats["lag_p99_s"] >= 0
    # Committed batches reach the judge as validated, not read back (the first poll may have read a few).
    assert stats["batches_fed_direct"] >= len(tables) // 2
    # What judging cost is the judge thread's own CPU: some, and no more than this whole process has used.
    health = client.get("/healthz").json()
    assert 0 < health["judge_cpu_s"] <= time.process_time()
    assert health["judge_cpu_s"] == pytest.approx(service_state.judge.stats()["cpu_s"], abs=1e-5)


def test_handed_batches_are_not_read_back_and_an_unhanded_commit_is(
    client, service_state, producer_token, fleet, monkeypatch
):
    tables, _ = fleet
    judge = service_state.judge
    assert judge.wait_idle(30)
    tail, real = judge.replay.tail, judge.replay.tail.poll
    reads: list[int] = []

    def counted(con):
        table = real(con)
        reads.append(0 if table is None else table.num_rows)
        return table

    monkeypatch.setattr(tail, "poll", counted)
    fed = judge.stats()["batches_fed_direct"]
    for table in tables:
        assert client.post("/v1/events", content=arrow_body(table), headers=auth(producer_token)).status_code == 200
    assert judge.wait_idle(60)
    assert reads == [] and judge.stats()["batches_fed_direct"] - fed == len(tables)  # all handed, none re-read
    judge.notify()  # a commit the judge was not handed: the next poll looks in the store
    assert judge.wait_idle(60)
    assert reads == [0]


def test_a_finding_is_saved_once_and_a_restarted_service_keeps_its_first_run(tmp_path, fleet):
    from kvtrail.audit.store import AuditStore
    from kvtrail.service.state import open_state

    tables, _ = fleet
    db = tmp_path / "s.duckdb"
    with AuditStore(db) as store:
        for t in tables:
            store.append(t)
    state = open_state(db)  # the judge judges what the store already holds
    assert state.judge.wait_idle(60)
    first = {r["finding_id"]: r["first_run_id"] for r in _persisted(state)}
    state.close()
    state = open_state(db)
    try:
        assert state.judge.wait_idle(60)
        again = {r["finding_id"]: r["first_run_id"] for r in _persisted(state)}
    finally:
        state.close()
    assert first and again == first


def test_a_failing_judge_never_fails_ingest_and_is_retried(client, service_state, producer_token, fleet, monkeypatch):
    tables, _ = fleet
    judge = service_state.judge
    judge.retry_s = 0.05
    real_poll = judge.replay.poll
    calls = {"n": 0}

    def flaky(con, **kw):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("judge broke")
        return real_poll(con, **kw)

    assert judge.wait_idle(30)
    monkeypatch.setattr(judge.replay, "poll", flaky)
    for table in tables:
        assert client.post("/v1/events", content=arrow_body(table), headers=auth(producer_token)).status_code == 200
    assert judge.wait_idle(60)
    assert judge.failures == 2
    assert {r["code"] for r in _persisted(service_state)} >= {"F1", "F6", "F7"}
    assert client.get("/healthz").json()["judge_failures"] == 2


def test_findings_a_failed_save_left_are_saved_by_the_retry(service_state, fleet, monkeypatch):
    from kvtrail.service import judge as judge_module

    tables, _ = fleet
    judge = service_state.judge
    judge.retry_s = 0.05
    assert judge.wait_idle(30)
    real_save = judge_module.save_findings
    calls = {"n": 0}

    def flaky_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("disk full")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(judge_module, "save_findings", flaky_save)
    with service_state.write_lock:
        for t in tables:
            service_state.store.append(t)
    judge.notify()
    assert judge.wait_idle(60)
    assert calls["n"] == 2 and judge.failures == 1
    assert {"F1", "F6", "F7"} <= {r["code"] for r in _persisted(service_state)}


def test_stats_before_any_poll_has_no_lag():

    import duckdb

    from kvtrail.service.judge import Judge

    con = duckdb.connect()
    j = Judge(con.cursor)
    try:
        stats = j.stats()
        # the kernels' warm-up at start is not judging: no CPU is counted before a poll
        assert stats["lag_p50_s"] is None and stats["polls"] == 0 and stats["cpu_s"] == 0.0
    finally:
        j.close(5)
        con.close()


def test_the_judge_keeps_the_minute_aggregates_equal_to_a_recompute(client, service_state, producer_token, fleet):
    from kvtrail.forensics.results import aggregates

    tables, _ = fleet
    for table in tables:
        r = client.post("/v1/events", content=arrow_body(table), headers=auth(producer_token))
        assert r.status_code == 200, r.text
    assert service_state.judge.wait_idle(60)
    counters = ", ".join(aggregates.COUNTER_NAMES)
    events_sql = f"SELECT producer_id, minute_ns, {counters} FROM minute_events WHERE events > 0 ORDER BY 1, 2"
    findings_sql = (
        "SELECT node, minute_ns, code, severity, sum(findings) FROM minute_findings GROUP BY ALL ORDER BY ALL"
    )
    with service_state.write_lock:
        cur = service_state.cursor()
        try:
            kept = cur.execute(events_sql).fetchall(), cur.execute(findings_sql).fetchall()
            assert not aggregates.uncovered_minutes(cur, aggregates.MIN_NS, aggregates.MAX_NS - aggregates.MINUTE_NS)
            aggregates.recompute(cur, None, None)
            rebuilt = cur.execute(events_sql).fetchall(), cur.execute(findings_sql).fetchall()
        finally:
            cur.close()
    assert kept[0] and sum(r[2] for r in kept[0]) == sum(t.num_rows for t in tables)
    assert kept[1] and kept == rebuilt


def test_the_aggregates_take_commits_on_their_interval_and_readers_see_those_minutes_uncovered(
    client, service_state, producer_token, fleet, monkeypatch
):
    import time

    from kvtrail.forensics.results import aggregates
    from kvtrail.service import judge as judge_module

    tables, _ = fleet
    judge = service_state.judge
    half = len(tables) // 2
    for table in tables[:half]:
        r = client.post("/v1/events", content=arrow_body(table), headers=auth(producer_token))
        assert r.status_code == 200, r.text
    assert judge.wait_idle(60)
    monkeypatch.setattr(judge_module, "AGGREGATE_INTERVAL_S", 3600.0)
    judge._agg_at = time.monotonic()
    cur = service_state.cursor()
    try:
        assert not aggregates.uncovered_minutes(cur, aggregates.MIN_NS, aggregates.MAX_NS - aggregates.MINUTE_NS)
        with service_state.write_lock:
            commits = [service_state.store.append(t) for t in tables[half:]]
        judge._oldest_ns = time.monotonic_ns()  # as if more commits were waiting: ingest goes on
        assert judge._poll([(c.table, dict(c.batches)) for c in commits], False)
        assert len(judge._agg_pending) == len(commits)  # judged, not yet added to the aggregates
        assert aggregates.uncovered_minutes(cur, aggregates.MIN_NS, aggregates.MAX_NS - aggregates.MINUTE_NS)
        judge._oldest_ns = None
        assert judge.wait_idle(60)  # waited for: they are added
        assert not judge._agg_pending
        assert not aggregates.uncovered_minutes(cur, aggregates.MIN_NS, aggregates.MAX_NS - aggregates.MINUTE_NS)
        counters = ", ".join(aggregates.COUNTER_NAMES)
        kept = cur.execute(f"SELECT producer_id, minute_ns, {counters} FROM minute_events ORDER BY 1, 2").fetchall()
    finally:
        cur.close()
    assert sum(r[2] for r in kept) == sum(t.num_rows for t in tables)


def test_a_judge_that_keeps_up_adds_aggregates_on_their_interval_and_once_a_poll_finds_no_commit(
    client, service_state, producer_token, fleet, monkeypatch
):
    """A judge that keeps up has nothing waiting after most polls; that alone does not add the minute
    aggregates (each add has a fixed cost): they wait for their interval, or for a poll with no commit."""
    import time

    from kvtrail.forensics.results import aggregates
    from kvtrail.service import judge as judge_module

    tables, _ = fleet
    judge = service_state.judge
    half = len(tables) // 2
    for table in tables[:half]:
        assert client.post("/v1/events", content=arrow_body(table), headers=auth(producer_token)).status_code == 200
    assert judge.wait_idle(60)
    monkeypatch.setattr(judge_module, "AGGREGATE_INTERVAL_S", 3600.0)
    judge._agg_at = time.monotonic()
    cur = service_state.cursor()
    try:
        with service_state.write_lock:
            commits = [service_state.store.append(t) for t in tables[half:]]
        judge._oldest_ns = None  # caught up: no commit waits behind these
        assert judge._poll([(c.table, dict(c.batches)) for c in commits], False)
        assert len(judge._agg_pending) == len(commits)  # judged, not yet added
        assert aggregates.uncovered_minutes(cur, aggregates.MIN_NS, aggregates.MAX_NS - aggregates.MINUTE_NS)
        assert judge._poll([], False)  # a whole poll with no new commit: added, nobody waiting for it
        assert not judge._agg_pending
        assert not aggregates.uncovered_minutes(cur, aggregates.MIN_NS, aggregates.MAX_NS - aggregates.MINUTE_NS)
        kept = cur.execute("SELECT sum(events) FROM minute_events").fetchone()[0]
    finally:
        cur.close()
    assert kept == sum(t.num_rows for t in tables)


def test_a_lagging_judge_holds_at_most_its_byte_bound_and_reads_the_rest_from_the_store(
    client, service_state, producer_token, fleet, monkeypatch
):
    """The commits handed to a judge that lags are bounded by their bytes too (not only by their count): past
    the bound it drops them and reads them back from the store, and judges exactly what a replay judges."""
    from kvtrail.service import judge as judge_mod

    tables, _ = fleet
    judge = service_state.judge
    assert judge.wait_idle(30)
    monkeypatch.setattr(judge_mod, "MAX_HELD_BYTES", 0)  # every commit passes it
    dropped, fed = judge.stats()["held_dropped"], judge.stats()["batches_fed_direct"]
    for table in tables:
        assert client.post("/v1/events", content=arrow_body(table), headers=auth(producer_token)).status_code == 200
    assert judge.wait_idle(60)
    assert judge.stats()["held_dropped"] - dropped == len(tables)  # each one left to the store ...
    assert judge.stats()["batches_fed_direct"] == fed  # ... none fed as handed
    cur = service_state.cursor()
    expected = replay_store(cur)  # the authoritative window re-run over the same store
    cur.close()
    assert expected and {r["finding_id"] for r in _persisted(service_state)} == {finding_id(f) for f in expected}
