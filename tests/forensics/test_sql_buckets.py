"""The SQL engine cuts page runs at bucket boundaries (``PAGE_BUCKET``): histories whose runs straddle
them give the replay's findings, pages in the order each event lists them."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.forensics.sql.engine import PAGE_BUCKET
from tests.conftest import T0
from tests.forensics.test_replay import ACTIONS, POOL, Oracle, Timeline
from tests.forensics.test_sql import compare, history_f5_f6_f7

# page ids moved so that the histories' pages (0..POOL) straddle a bucket boundary
OFFSET = PAGE_BUCKET * 3 - POOL // 2


def _shifted(events: list[dict], offset: int) -> list[dict]:
    """Every page id plus ``offset``, and pools that large."""
    out = []
    for e in events:
        if e.get("pages"):
            e = {**e, "pages": [p + offset for p in e["pages"]]}
        if e["kind"] == "node_config":
            pages = e["pool_pages"] + offset
            e = {
                **e,
                "pool_pages": pages,
                "pool_tokens": pages * e["page_size"],
                "context_tokens": pages * e["page_size"],
            }
        out.append(e)
    return out


def test_hand_built_history_across_a_bucket_boundary():
    tl = history_f5_f6_f7()
    with AuditStore(":memory:") as store:
        store.append(from_dicts(_shifted(tl.events, OFFSET - 1)))
        got = compare(store)
    f5 = [f for f in got if f.code == "F5"]
    assert f5[0].pages == tuple(p + OFFSET - 1 for p in (2, 3, 7))
    assert {p // PAGE_BUCKET for f in got for p in f.pages} == {2, 3}


def test_long_runs_over_many_buckets():
    tl = Timeline()
    tl.node("d", pool_pages=1024)
    long = list(range(10, 10 + 5 * PAGE_BUCKET))
    tl.alloc("d", "r1", long)
    tl.write("d", "r1", long)
    tl.free("d", "r1", long)
    tl.alloc("d", "r2", long[::-1])  # the same pages, listed backwards
    tl.read("d", "r2", long[30:300])  # F1 across five buckets, victim r1
    tl.alloc("d", "r3", [PAGE_BUCKET - 1, PAGE_BUCKET, 2 * PAGE_BUCKET])  # F6 on three buckets
    tl.write("d", "r1", [PAGE_BUCKET * 2 - 1, PAGE_BUCKET * 2])  # F7, one page each side
    with AuditStore(":memory:") as store:
        store.append(from_dicts(tl.events))
        got = compare(store)
    assert sorted(f.code for f in got) == ["F1", "F6", "F7"]
    f1 = next(f for f in got if f.code == "F1")
    assert f1.pages == tuple(long[30:300])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_property_sql_matches_replay_across_buckets(data):
    tl = Timeline()
    tl.node("d", pool_pages=POOL)
    oracle = Oracle(tl)
    for action in data.draw(st.lists(st.sampled_from(ACTIONS), max_size=30)):
        oracle.step(action, data)
    with AuditStore(":memory:") as store:
        store.append(from_dicts(_shifted(tl.events, OFFSET)))
        compare(store)
        lo = data.draw(st.integers(0, len(tl.events)))
        compare(store, T0 + 1000 * lo, T0 + 1000 * data.draw(st.integers(lo, len(tl.events))))
