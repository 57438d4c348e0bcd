"""Prefix-cache hits on the compiled path: the same findings, page state and shares as the Python handlers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrail.audit.batch import from_dicts
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay import shares as S
from kvtrail.forensics.replay.handlers import EventHandlers
from kvtrail.forensics.replay.pagestate import PageState
from kvtrail.sim.fleet import FleetConfig, fleet_batches
from tests.forensics.test_replay import Timeline
from tests.forensics.test_replay_fast import assert_same, replay, split

K = pytest.importorskip("kvtrail.forensics.replay.kernels")


@pytest.fixture
def few_slots(monkeypatch):
    """Pools start with 2 share slots: the kernel runs out of room and the handlers grow them, often."""
    monkeypatch.setattr(S, "INITIAL_SLOTS", 2)


# ---- the shares' layout: Python statement and compiled copies --------------------------------------------

OPS = st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.integers(0, 5), st.integers(-3, 3)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_compiled_share_functions_follow_the_python_ones(ops):
    """Random adds and removes (no growth) on a Python and a compiled copy: the same arrays after each."""
    py, nb = S.PrefixShares(16), S.PrefixShares(16)
    heads = [np.full(8, -1, np.int32) for _ in range(2)]
    counts = [np.zeros(8, np.int32) for _ in range(2)]
    live: dict[tuple[int, int], int] = {}
    for add, p, r, h in ops:
        s_py = S.share_find(py.index, py.page, py.req, p, r)
        assert s_py == K.share_find(nb.index, nb.page, nb.req, p, r) == live.get((p, r), -1)
        if add and s_py < 0 and py.num_entries < py.num_slots:
            live[(p, r)] = S.share_insert(*py.arrays(), heads[0], counts[0], p, r, h)
            assert K.share_insert(*nb.arrays(), heads[1], counts[1], p, r, h) == live[(p, r)]
        elif not add and s_py >= 0:
            S.share_remove(py.index, py.page, py.req, py.prev, py.next, py.meta, heads[0], counts[0], s_py)
            K.share_remove(nb.index, nb.page, nb.req, nb.prev, nb.next, nb.meta, heads[1], counts[1], s_py)
            del live[(p, r)]
        for x, y in zip(py.arrays() + (heads[0], counts[0]), nb.arrays() + (heads[1], counts[1])):
            np.testing.assert_array_equal(x, y)
    pool = PageState.empty(7)
    pool.shares, pool.share_head, pool.nshared = py, heads[0], counts[0]
    assert {(p, r) for p, held in pool.shared().items() for r in held} == set(live)
    assert all(len(pool.sharers(p)) == counts[0][p] for p in range(8))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 30)), max_size=120))
def test_growth_keeps_every_entry(pairs):
    pool = PageState.empty(40)
    pool.shares = S.PrefixShares(1)
    want: dict[int, dict[int, int]] = {}
    for k, (p, r) in enumerate(pairs):
        pool.share(p, r, k)
        want.setdefault(p, {})[r] = k
    assert pool.shared() == {p: want[p] for p in sorted(want)}
    assert pool.shares.num_entries == sum(len(v) for v in want.values())
    for p, held in want.items():
        assert pool.sharers(p) == set(held) and pool.held_by(np.array([p]), next(iter(held)))[0]


# ---- prefix-heavy histories: fast equals pure ------------------------------------------------------------

STEP = st.tuples(
    st.sampled_from(("fill", "serve", "serve", "serve", "hit", "read", "write", "alloc", "free", "evict", "odd")),
    st.integers(0, 7),  # request
    st.lists(st.integers(1, 9), min_size=1, max_size=5),  # pages
    st.sampled_from((0, 0, 0, 1)),  # hash salt: a hit keyed by another hash than the page holds is a stale hit
    st.booleans(),  # serve: free the hit pages after the read
)


def prefix_history(steps, tenants: int) -> pa.Table:
    """Requests fill pages keyed by block hashes, others hit and read them; ``tenants`` tenants."""
    tl = Timeline()
    tl.tenant_of = {f"r{r}": f"t{r % tenants}" for r in range(8)}
    tl.node("a", pool_pages=12)
    for kind, r, pages, salt, then_free in steps:
        rid, unique = f"r{r}", sorted(set(pages))
        keys = [100 * salt + p for p in unique]
        if kind == "fill":
            tl.alloc("a", rid, unique, "decode_reservation")
            tl.write("a", rid, unique, block_hashes=keys)
            tl.free("a", rid, unique)
        elif kind in ("serve", "hit"):
            tl.alloc("a", rid, unique, "prefix_hit", block_hashes=keys)
            if kind == "serve":
                tl.read("a", rid, unique)
                if then_free:
                    tl.free("a", rid, unique)
        elif kind == "odd":  # pages listed twice, or hashes not one per page: the handler's cases
            tl.alloc("a", rid, pages, "prefix_hit", block_hashes=[100 * salt + p for p in pages][: 1 + salt])
        elif kind == "read":
            tl.read("a", rid, pages)
        elif kind == "write":
            tl.write("a", rid, unique, block_hashes=keys)
        elif kind == "alloc":
            tl.alloc("a", rid, pages, "decode_reservation")
        elif kind == "free":
            tl.free("a", rid, pages)
        else:
            tl.add("a", "pages_freed", pages=pages, free_reason="eviction")
    return from_dicts(tl.events)


@pytest.mark.parametrize("tenants", [1, 2, 8])
@pytest.mark.parametrize("allow", [False, True])
def test_prefix_histories_fast_equals_pure(few_slots, tenants, allow):
    @settings(max_examples=60, deadline=None)
    @given(st.lists(STEP, max_size=60), st.lists(st.integers(0, 80), max_size=2))
    def check(steps, cuts):
        assert_same(
            split(prefix_history(steps, tenants), cuts), policy=ForensicsPolicy(allow_tenant_cache_sharing=allow)
        )

    check()


def served_by_the_cache(tenant_of) -> pa.Table:
    """r0 fills pages 1-6 keyed by their hashes; r1..r9 hit and read them, then free them."""
    tl = Timeline()
    tl.tenant_of = tenant_of
    tl.node("a", pool_pages=16)
    tl.alloc("a", "r0", [1, 2, 3, 4, 5, 6])
    tl.write("a", "r0", [1, 2, 3, 4, 5, 6], block_hashes=[11, 12, 13, 14, 15, 16])
    for k in range(1, 10):
        rid = f"r{k}"
        tl.alloc("a", rid, [1, 2, 3], "prefix_hit", block_hashes=[11, 12, 13])
        tl.alloc("a", rid, [7 + k % 4], "decode_growth")
        tl.read("a", rid, [1, 2, 3, 7 + k % 4])
        tl.free("a", rid, [1, 2, 3, 7 + k % 4])
    return from_dicts(tl.events)


def handled(monkeypatch, table, **kw) -> list[str]:
    """The kinds the handlers were given on the fast path."""
    calls: list[str] = []

    def recording(kind: str):
        handler = getattr(EventHandlers, "on_" + kind)

        def on_event(self, ev) -> None:
            calls.append(kind)
            handler(self, ev)

        return on_event

    with monkeypatch.context() as m:
        for kind in ("node_config", "pages_allocated", "pages_freed", "kv_written", "kv_read"):
            m.setattr(EventHandlers, "on_" + kind, recording(kind))
        replay([table], True, **kw)
    return calls


def test_the_kernel_replays_same_tenant_hits_and_stops_at_a_cross_tenant_read(monkeypatch):
    same = served_by_the_cache({f"r{k}": "acme" for k in range(10)})
    assert assert_same([same]) == []
    assert handled(monkeypatch, same) == ["node_config"]
    cross = served_by_the_cache({f"r{k}": "acme" if k != 4 else "other" for k in range(10)})
    found = assert_same([cross])
    assert [(f.code, f.request_id) for f in found] == [("F10", "r4")]
    assert handled(monkeypatch, cross) == ["node_config", "kv_read"]
    assert handled(monkeypatch, cross, policy=ForensicsPolicy(allow_tenant_cache_sharing=True)) == ["node_config"]


def test_a_stale_hit_read_is_a_foreign_read():
    """A hit keyed by a hash the page no longer holds (rewritten since) is not the cache working: F1."""
    tl = Timeline()
    tl.tenant_of = {"r0": "t", "r1": "t", "r2": "t"}
    tl.node("a", pool_pages=8)
    tl.alloc("a", "r0", [1, 2])
    tl.write("a", "r0", [1, 2], block_hashes=[11, 12])
    tl.alloc("a", "r1", [1, 2], "prefix_hit", block_hashes=[11, 99])
    tl.read("a", "r1", [1, 2])
    found = assert_same([from_dicts(tl.events)])
    assert [(f.code, f.request_id, f.pages) for f in found] == [("F1", "r1", (2,))]


def test_fleet_histories_fast_equals_pure(few_slots):
    """The fleet simulator's prefix cache, shared within tenants (and across them: F10)."""
    base = FleetConfig(
        seed=5,
        hours=0.004,
        rate_per_s=10,
        prefill_nodes=2,
        decode_nodes=2,
        tenants=3,
        chunk_tokens=4096,
        prefix_share_prob=0.9,
        public_doc_prob=0.3,
    )
    for cfg in (base, dataclasses.replace(base, cache_namespaces=False)):
        tables = list(fleet_batches(cfg))
        found = assert_same(tables)
        assert found == replay(tables, False).findings()
    assert any(f.code == "F10" for f in found)
