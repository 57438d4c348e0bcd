"""The replay's faster paths give what the plain ones give: the store reader's slicing and read-ahead,
its row order, bulk release bookkeeping, the released-list copy and the radix-eviction handler."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrail.audit.store import AuditStore
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay import pagestate
from kvtrail.forensics.replay.event import ReplayEvent
from kvtrail.forensics.replay.handlers import EventHandlers
from kvtrail.forensics.replay.joins import CrossNodeJoins
from kvtrail.forensics.replay.pagestate import PageState
from kvtrail.forensics.replay.state import ReplayState
from kvtrail.sim.fleet import FleetConfig, fleet_batches

pytest.importorskip("numba")

from kvtrail.forensics.replay.kernels import copy_lists  # noqa: E402  (needs numba)
from kvtrail.forensics.replay.source import _Keys, _slice_bounds, store_batches  # noqa: E402
from tests.forensics.test_source import _rows  # noqa: E402  (the reader's rows, as its own test reads them)

FLEET = FleetConfig(
    seed=7,
    hours=0.003,
    rate_per_s=10,
    prefill_nodes=1,
    decode_nodes=2,
    tenants=3,
    chunk_tokens=4096,
    events_per_batch=400,
)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with AuditStore(tmp_path_factory.mktemp("read_paths") / "s.duckdb") as st_:
        for t in fleet_batches(FLEET):
            st_.append(t)
        yield st_


def _read(con, **kw) -> tuple[list[tuple], int]:
    got, slices = [], 0
    for b in store_batches(con, "TRUE", [], **kw):
        got += _rows([dataclasses.replace(b, pages=b.pages.copy())])
        slices += 1
    return got, slices


def test_read_ahead_or_not_and_any_slicing_read_the_same(store):
    whole, one = _read(store.con, page_events_per_slice=10**9, events_per_slice=10**9)
    by_events, many = _read(store.con, page_events_per_slice=10**9, events_per_slice=300)
    in_turn, _ = _read(store.con, page_events_per_slice=10**9, events_per_slice=300, read_ahead=False)
    assert one == 1 and many > 3 and len(whole) > 1000
    assert by_events == whole and in_turn == whole


def test_slices_count_events_and_page_events_together(store):
    def slices(pe: int, ev: int) -> int:
        return len(_slice_bounds(store.con, "TRUE", [], pe, ev)) - 1

    num_events, num_pages = store.con.execute("SELECT count(*), sum(num_pages) FROM events").fetchone()
    assert slices(10**12, 10**12) == 1
    assert slices(10**12, num_events // 4) >= 4  # by events alone
    assert slices(num_pages // 4, 10**12) >= 4  # by page-events alone
    assert slices(num_pages // 4, num_events // 4) >= 8  # half a slice of each is a slice


def test_slices_count_only_the_selected_producers_and_the_window(store):
    """A one-node question on a fleet's store is sized by that node's batches, inside the window's span."""
    con = store.con
    num_events = con.execute("SELECT count(*) FROM events").fetchone()[0]
    node, mine = con.execute("SELECT node, count(*) FROM events_v GROUP BY node ORDER BY 2 LIMIT 1").fetchone()
    assert mine < num_events // 2
    per = max(mine // 4, 1)
    one_node = len(_slice_bounds(con, "node = ?", [node], 10**12, per)) - 1
    assert 3 <= one_node <= 6  # ~mine / per, not ~num_events / per
    assert len(_slice_bounds(con, "TRUE", [], 10**12, per)) - 1 > 2 * one_node
    lo, hi = con.execute("SELECT min(wall_ns), max(wall_ns) FROM events").fetchone()
    tenth = "wall_ns >= ? AND wall_ns < ?"
    in_tenth = con.execute(f"SELECT count(*) FROM events WHERE {tenth}", [lo, lo + (hi - lo) // 10]).fetchone()[0]
    got = len(_slice_bounds(con, tenth, [lo, lo + (hi - lo) // 10], 10**12, max(in_tenth // 2, 1))) - 1
    assert got <= 4  # the window's part of the batches that overlap it, not those batches whole


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6)), max_size=40))
def test_rows_by_producer_and_seq_as_a_lexsort_orders_them(rows):
    producer = np.array([p for p, _ in rows], np.int64)
    seq = np.array([s for _, s in rows], np.int64)
    keys = _Keys(producer + 100, seq, producer)
    assert keys.order.tolist() == np.lexsort((seq, producer)).tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 7)), max_size=30), st.integers(1, 12))
def test_bulk_releases_keep_what_one_by_one_keeps(releases, cap):
    flat = np.arange(sum(n for _, n in releases), dtype=np.int32)
    ends = np.cumsum([n for _, n in releases]).astype(np.int64)
    reqs = np.array([r for r, _ in releases], np.int64)
    old = pagestate.RELEASED_CAP_PAGES
    pagestate.RELEASED_CAP_PAGES = cap  # a small cap: requests are forgotten as the lists arrive
    try:
        one, bulk = PageState.empty(4), PageState.empty(4)
        lo = 0
        for r, hi in zip(reqs.tolist(), ends.tolist()):
            one.remember_release(r, flat[lo:hi])
            lo = hi
        bulk.remember_releases(reqs, flat, ends)
    finally:
        pagestate.RELEASED_CAP_PAGES = old
    assert bulk.released_pages == one.released_pages
    assert list(bulk.released) == list(one.released)
    assert all([a.tolist() for a in bulk.released[r]] == [a.tolist() for a in one.released[r]] for r in one.released)


def test_copy_lists_puts_the_lists_back_to_back():
    pages = np.arange(100, 140, dtype=np.int32)
    starts, lengths = np.array([5, 0, 30, 12], np.int64), np.array([3, 2, 0, 4], np.int64)
    out = np.empty(int(lengths.sum()), np.int32)
    copy_lists(pages, starts, lengths, out)
    assert out.tolist() == [105, 106, 107, 100, 101, 112, 113, 114, 115]


def _reference_eviction(pool: PageState, pages: np.ndarray) -> None:
    """The radix-eviction rule as first written: every holder drops every page."""
    everyone = {int(o) for o in pool.owner[pages] if o >= 0}
    for p in pages.tolist():
        everyone |= pool.holders(p)
    for r in everyone:
        for p in pages.tolist():
            pool.drop(p, r)
        pool.remember_release(r, pages)


def _pool_from(holdings, num_pages: int) -> PageState:
    pool = PageState.empty(num_pages)
    for p, owner, extra, sharers in holdings:
        if owner is not None:
            pool.owner[p] = owner
            for r in extra:
                pool.extra.setdefault(p, set()).add(r)
        for r in sharers:
            pool.share(p, r, 1000 + r)
    return pool


def _snapshot(pool: PageState):
    return (
        [a.tolist() for a in pool.arrays()],
        [a.tolist() for a in pool.shares.arrays()],
        {p: sorted(s) for p, s in pool.extra.items()},
        OrderedDict((r, [a.tolist() for a in lst]) for r, lst in pool.released.items()),
        pool.released_pages,
    )


_HOLDING = st.tuples(
    st.one_of(st.none(), st.integers(0, 6)),
    st.sets(st.integers(0, 6), max_size=2),
    st.sets(st.integers(0, 6), max_size=3),
)


@settings(max_examples=80, deadline=None)
@given(st.lists(_HOLDING, min_size=1, max_size=12), st.lists(st.integers(1, 12), min_size=1, max_size=12))
def test_radix_eviction_drops_as_every_holder_dropping_every_page(holdings, evicted):
    num_pages = 12
    holdings = [(p + 1, o, {r for r in e if r != o}, s) for p, (o, e, s) in enumerate(holdings)]
    pages = np.array(evicted, np.int64)
    want = _pool_from(holdings, num_pages)
    _reference_eviction(want, pages)
    state = ReplayState(CrossNodeJoins(ForensicsPolicy()))
    state.pools[("c", "n")] = got = _pool_from(holdings, num_pages)
    fields = dict.fromkeys(ReplayEvent._fields)
    fields.update(
        kind="pages_freed",
        seq=1,
        wall_ns=1,
        node_key=("c", "n"),
        instance="i",
        key=(1, 1),
        ord=0,
        pages=pages,
        num_dst_pages=0,
    )
    EventHandlers(state, ForensicsPolicy()).handle(ReplayEvent(**fields))
    assert _snapshot(got) == _snapshot(want)
