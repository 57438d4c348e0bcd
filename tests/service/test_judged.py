"""Answers from the live judge: for a window covering the whole store, ``affected`` and ``findings`` come
from the findings the judge holds (no replay) and equal the CLI's answers; other windows are replayed."""

from __future__ import annotations

import json

import pytest

from kvtrail.answers.tables import json_text
from kvtrail.forensics import AFFECTED_CODES, Exclusions, Window, ask_affected, ask_findings
from kvtrail.service import judged
from kvtrail.timeutil import format_utc
from tests.forensics.incident_fixture import W0, W1
from tests.service.access_fixtures import bearer, served_fixture  # noqa: F401

EXCL = Exclusions(tenants=(("hooli", "tests"),))


def _span(served) -> tuple[int, int]:
    cur = served.state.cursor()
    try:
        return cur.execute("SELECT min(min_wall_ns), max(max_wall_ns) FROM batches").fetchone()
    finally:
        cur.close()


def _same(a, b) -> None:
    assert a.rows.equals(b.rows) and a.excluded.equals(b.excluded) and a.gaps.equals(b.gaps)
    assert (a.notes, a.warnings) == (b.notes, b.warnings)


def test_a_covering_window_is_answered_from_the_judge_as_the_cli_answers(served):
    first, last = _span(served)
    cur = served.state.cursor()
    try:
        for w in (Window(None, None), Window(first - 10**9, last + 10**9), Window(first, None, tenant="acme")):
            with judged.judged_findings(cur, served.state, w) as found:
                assert found is not None, w
                _same(
                    judged.affected_answer(cur, w, found, EXCL),
                    ask_affected(served.state.store.cursor(), w, exclusions=EXCL),
                )
                for codes in ((), tuple(sorted(AFFECTED_CODES)), ("F2", "F8")):
                    _same(
                        judged.findings_answer(cur, w, found, codes, EXCL),
                        ask_findings(served.state.store.cursor(), w, codes=codes, exclusions=EXCL),
                    )
        for w in (Window(W0, W1), Window(first + 1, None), Window(None, last - 1)):
            with judged.judged_findings(cur, served.state, w) as found:
                assert found is None, w  # replayed as the CLI does
    finally:
        cur.close()


@pytest.mark.parametrize("path", ["/v1/affected", "/v1/findings"])
def test_the_routes_give_the_cli_rows_for_a_covering_window(served, path):
    first, last = _span(served)
    w = Window(first - 10**9, last + 10**9)
    expected = (ask_affected if path == "/v1/affected" else ask_findings)(served.state.store.cursor(), w)
    assert len(expected.rows) > 0
    for _ in range(2):  # the second from the same judged state
        r = served.client.get(
            path,
            params={"from": format_utc(w.from_ns), "to": format_utc(w.to_ns)},
            headers=bearer(served.tokens["operator"]),
        )
        assert r.status_code == 200, r.text
        assert r.json() == json.loads(json_text(expected.rows))
        assert json.loads(r.headers["x-kvtrail-answer"])["warnings"] == list(expected.warnings)


def test_answers_on_one_judged_snapshot_are_computed_once(served):
    first, last = _span(served)
    params = {"from": format_utc(first - 10**9), "to": format_utc(last + 10**9)}
    cache = served.state.answers
    bodies = []
    for _ in range(3):
        before = (cache.hits, cache.misses)
        r = served.client.get("/v1/affected", params=params, headers=bearer(served.tokens["operator"]))
        assert r.status_code == 200, r.text
        bodies.append(r.json())
    assert bodies[0] == bodies[1] == bodies[2]
    assert cache.hits - before[0] >= 1 and cache.misses == before[1]  # the last one came from the cache
    wider = {**params, "from": format_utc(first - 2 * 10**9)}  # another covering window: the same question
    other = served.client.get("/v1/affected", params=wider, headers=bearer(served.tokens["operator"]))
    assert other.status_code == 200, other.text
    assert other.json() == bodies[0] and cache.misses == before[1]  # answered from the cache
    narrower = {**params, "from": format_utc(first + 1)}  # not covering: replayed, not cached
    r = served.client.get("/v1/affected", params=narrower, headers=bearer(served.tokens["operator"]))
    assert r.status_code == 200, r.text
    assert cache.misses == before[1]
    acme = {**params, "tenant": "acme"}  # another filter: another question
    r = served.client.get("/v1/affected", params=acme, headers=bearer(served.tokens["operator"]))
    assert r.status_code == 200, r.text
    assert cache.misses == before[1] + 2  # its answer and its window's context


def test_a_covering_window_asks_what_the_unbounded_window_asks(served):
    first, last = _span(served)
    con = served.state.store.cursor()
    try:
        for tenant, node in ((None, None), ("acme", None), (None, "prefill-0")):
            unbounded = Window(None, None, tenant=tenant, node=node)
            for w in (
                Window(first, last, tenant=tenant, node=node),
                Window(first - 10**12, last + 10**12, tenant=tenant, node=node),
            ):
                _same(ask_affected(con, w, exclusions=EXCL), ask_affected(con, unbounded, exclusions=EXCL))
                for codes in ((), ("F2", "F8")):
                    _same(
                        ask_findings(con, w, codes=codes, exclusions=EXCL),
                        ask_findings(con, unbounded, codes=codes, exclusions=EXCL),
                    )
            assert judged.covering(Window(first, last, tenant, node), (first, last)) == unbounded
            assert judged.covering(Window(first + 1, last, tenant, node), (first, last)) is None
            assert judged.covering(Window(first, last - 1, tenant, node), (first, last)) is None
    finally:
        con.close()


def test_questions_on_one_judged_snapshot_share_the_window_context(served):
    first, last = _span(served)
    params = {"from": format_utc(first - 3 * 10**9), "to": format_utc(last + 10**9), "node": "prefill-0"}
    cache = served.state.answers
    before = (cache.hits, cache.misses)
    r = served.client.get("/v1/affected", params=params, headers=bearer(served.tokens["operator"]))
    assert r.status_code == 200, r.text
    assert (cache.hits, cache.misses) == (before[0], before[1] + 2)  # the answer and the window's context
    r = served.client.get("/v1/findings", params=params, headers=bearer(served.tokens["operator"]))
    assert r.status_code == 200, r.text
    assert (cache.hits, cache.misses) == (before[0] + 1, before[1] + 3)  # the context came from the cache


def test_the_answer_cache_waits_for_a_running_computation_and_keeps_no_failure():
    import threading
    import time

    cache = judged.AnswerCache(size=2)
    calls: list[str] = []

    def slow() -> str:
        calls.append("slow")
        time.sleep(0.2)
        return "answer"

    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(cache.get("k", slow))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == ["answer"] * 3 and calls == ["slow"]  # one computation, three answers

    def broken() -> str:
        raise RuntimeError("store went away")

    with pytest.raises(RuntimeError):
        cache.get("bad", broken)
    assert cache.get("bad", lambda: "fixed") == "fixed"  # a failure is not kept
    cache.get("third", lambda: "x")
    assert cache.get("k", lambda: "recomputed") == "recomputed"  # the oldest was evicted (size 2)


def test_questions_on_one_judged_snapshot_share_its_views_and_old_ones_are_detached(served):
    first, last = _span(served)
    params = {"from": format_utc(first - 4 * 10**9), "to": format_utc(last + 10**9), "tenant": "umbrella"}
    snaps = served.state.snapshots
    cur = served.state.cursor()
    try:  # push out whatever snapshots earlier questions left, so these questions need a new one
        for n in range(snaps.keep):
            with snaps.use(cur, {-100 - n: 0}):
                pass
    finally:
        cur.close()
    made = snaps.made
    for path in ("/v1/affected", "/v1/findings"):
        r = served.client.get(path, params=params, headers=bearer(served.tokens["operator"]))
        assert r.status_code == 200, r.text
    assert snaps.made == made + 1  # one snapshot for both questions (and their shared context)

    def attached() -> int:
        cur = served.state.cursor()
        try:
            return cur.execute(
                "SELECT count(*) FROM duckdb_databases() WHERE database_name LIKE 'kvtrail_snapshot_%'"
            ).fetchone()[0]
        finally:
            cur.close()

    assert attached() <= snaps.keep + snaps.spare
    moved = snaps.moved
    cur = served.state.cursor()
    try:  # snapshots of other judged states push the oldest out: moved to the next states, or detached
        for n in range(snaps.keep + snaps.spare + 2):
            marks = {pid: 0 for pid in served.state.committer.heads} | {-1 - n: 0}
            with snaps.use(cur, marks):
                assert cur.execute("SELECT current_database()").fetchone()[0].startswith("kvtrail_snapshot_")
    finally:
        cur.close()
    assert snaps.moved > moved  # the views were not made again for every state
    assert attached() <= snaps.keep + snaps.spare


def _counts(cur) -> tuple:
    return cur.execute(
        "SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM batches), (SELECT count(*) FROM producers),"
        " (SELECT count(*) FROM page_runs)"
    ).fetchone()


def test_a_moved_snapshot_shows_what_a_snapshot_made_afresh_shows(served):
    heads = list(served.state.committer.heads.items())
    assert len(heads) >= 2
    states = [dict(heads), dict(heads[:1]), dict(heads[1:]), {}, dict(heads)]  # a producer's batches in or out
    fresh = judged.SharedSnapshots(keep=1, spare=0)  # every state made afresh
    reused = judged.SharedSnapshots(keep=1, spare=1)  # later states moved from the spare
    seen = set()
    cur = served.state.cursor()
    try:
        for marks in states:
            with fresh.use(cur, marks):
                want = _counts(cur)
            with reused.use(cur, marks):
                assert _counts(cur) == want, marks
            seen.add(want)
        assert len(seen) >= 3  # the states show different stores
        assert fresh.moved == 0 and fresh.made == len(states)
        # the first two made (the first is kept while the second is made), every later one moved
        assert reused.moved == len(states) - 2 and reused.made == len(states)
    finally:
        cur.close()


def test_a_spare_snapshot_is_made_again_once_the_store_has_another_table(served):
    snaps = judged.SharedSnapshots(keep=1, spare=1)
    heads = dict(served.state.committer.heads)
    cur = served.state.cursor()
    try:
        with snaps.use(cur, heads):
            pass
        with snaps.use(cur, {p: 0 for p in heads}):  # the first becomes the spare
            pass
        cur.execute("CREATE TABLE test_added_later (x INTEGER)")
        cur.execute("INSERT INTO test_added_later VALUES (7)")
        moved = snaps.moved
        with snaps.use(cur, {next(iter(heads)): 0}):
            assert snaps.moved == moved  # made afresh: a moved one would not show the new table
            assert cur.execute("SELECT x FROM test_added_later").fetchone() == (7,)
    finally:
        cur.execute("DROP TABLE IF EXISTS test_added_later")
        cur.close()
