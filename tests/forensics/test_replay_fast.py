"""The replay engine's compiled fast path gives exactly the pure path's findings and page state."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.events import Producer
from kvtrail.audit.store import AuditStore
from kvtrail.forensics.findings import AFFECTED_CODES
from kvtrail.forensics.replay.batch import ENGINE_ORDER, in_engine_order
from kvtrail.forensics.replay.engine import ReplayEngine, replay_store
from kvtrail.forensics.replay.handlers import EventHandlers
from kvtrail.forensics.replay.pagestate import PAGE_ARRAYS
from kvtrail.sim.synth import synth_batches
from tests.forensics.test_replay import ACTIONS, POOL, Oracle, Timeline

pytest.importorskip("numba")

_STATE = tuple(spec.name for spec in PAGE_ARRAYS)


def replay(tables, fast, **kw):
    engine = ReplayEngine(fast=fast, **kw)
    for t in tables:
        engine.feed(t)
    return engine


def assert_same(tables, **kw):
    """Both paths over the same batches: equal findings, equal page state, equal bookkeeping."""
    fast, pure = replay(tables, True, **kw), replay(tables, False, **kw)
    assert fast.fast_path is not None and pure.fast_path is None
    assert fast.findings() == pure.findings()
    fs, ps = fast.state, pure.state
    assert fs.requests == ps.requests and fs.tenants == ps.tenants and fs.num_events == ps.num_events
    assert fs.request_tenants == ps.request_tenants and fs.tenant_since == ps.tenant_since
    assert fs.request_index == ps.request_index
    assert fs.joins.role == ps.joins.role and fs.joins.hit_pages == ps.joins.hit_pages
    if "codes" not in kw:  # without the joins, only the handlers run for Python events still feed them
        assert sorted(fs.joins.forward_writes) == sorted(ps.joins.forward_writes)
    assert fs.pools.keys() == ps.pools.keys()
    for key, a in fs.pools.items():
        b = ps.pools[key]
        for name in _STATE:
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=f"{key} {name}")
        assert a.extra == b.extra and a.shared() == b.shared()
        for x, y in zip(a.shares.arrays(), b.shares.arrays()):  # the same slot for every entry
            np.testing.assert_array_equal(x, y, err_msg=f"{key} shares")
        assert list(a.released) == list(b.released)
        for r, lists in a.released.items():
            assert [x.tolist() for x in lists] == [x.tolist() for x in b.released[r]]
    return fast.findings()


def split(table: pa.Table, cuts: list[int]) -> list[pa.Table]:
    """The table in consecutive slices (the engine keeps its state across feeds)."""
    bounds = sorted({0, table.num_rows, *(c % (table.num_rows + 1) for c in cuts)})
    return [table.slice(a, b - a) for a, b in zip(bounds, bounds[1:])]


# ---- the oracle histories of test_replay.py ----------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_oracle_histories_fast_equals_pure(data):
    tl = Timeline()
    tl.node("d", pool_pages=POOL)
    oracle = Oracle(tl)
    for action in data.draw(st.lists(st.sampled_from(ACTIONS), max_size=40)):
        oracle.step(action, data)
    table = from_dicts(tl.events)
    assert_same(split(table, data.draw(st.lists(st.integers(0, 200), max_size=3))))


# ---- free-form histories: every page kind, shared pages, evictions, restarts, two nodes ----------------

EVENT = st.tuples(
    st.sampled_from(
        (
            "alloc",
            "alloc",
            "growth",
            "prefix",
            "free",
            "free",
            "evict",
            "write",
            "write",
            "read",
            "read",
            "restart",
            "response",
            "unverified",
        )
    ),
    st.sampled_from(("a", "b")),  # node
    st.integers(0, 5),  # request
    st.lists(st.integers(1, 9) | st.sampled_from((-1, 0, 11)), min_size=0, max_size=4),  # pages: repeats,
    # the padding page, a negative id and one beyond the pool (the handler grows it) included
    st.booleans(),  # digests / block hashes on writes and reads
)


def free_form(events) -> pa.Table:
    tl = Timeline()
    tl.node("a", pool_pages=8)
    tl.node("b", pool_pages=8, instance="b1")
    for r in range(6):  # two tenants reuse each request id; r5's events name no tenant (r2's id: r2's request)
        tl.id_of[f"r{r}"], tl.tenant_of[f"r{r}"] = f"x{r % 3}", "t-a" if r < 3 else "t-b"
    restarts = 0
    for kind, node, r, pages, extra in events:
        rid = f"r{r}"
        before = len(tl.events)
        tag = {"page_digests": [abs(p) * 7 for p in pages]} if extra else {}
        if kind in ("alloc", "growth"):
            tl.alloc(node, rid, pages, "decode_growth" if kind == "growth" else "decode_reservation")
        elif kind == "prefix" and pages:
            tl.alloc(node, rid, pages, "prefix_hit", block_hashes=[100 + p for p in pages])
        elif kind == "free":
            tl.free(node, rid, pages)
        elif kind == "evict":
            tl.add(node, "pages_freed", pages=pages, free_reason="eviction")
        elif kind == "write":
            hashes = {"block_hashes": [100 + p for p in pages]} if extra and r % 2 else {}
            tl.write(node, rid, pages, **tag, **hashes)
        elif kind == "read":
            tl.add(node, "kv_read", rid, pages=pages, **tag)
        elif kind == "restart" and r == 0:
            restarts += 1
            tl.node(node, pool_pages=8 + restarts, instance=f"{node}{restarts + 1}")
        elif kind == "unverified":  # a landing decode cannot prove: its pages' writer becomes unknown
            tl.add(node, "transfer_received", rid, r, pages=pages, num_tokens=0, status="unverified")
        elif kind == "response":
            tl.add(node, "response_sent", rid, http_status=200, prompt_tokens=10, completion_tokens=1, latency_ns=5)
        if r == 5 and len(tl.events) > before and tl.events[-1].get("request"):
            tl.events[-1]["request"].pop("tenant_id")
    return from_dicts(tl.events)


@settings(max_examples=300, deadline=None)
@given(st.lists(EVENT, max_size=60), st.lists(st.integers(0, 100), max_size=3))
def test_free_form_histories_fast_equals_pure(events, cuts):
    assert_same(split(free_form(events), cuts))


@settings(max_examples=50, deadline=None)
@given(st.lists(EVENT, max_size=60))
def test_codes_skip_joins_and_keep_the_affected_findings(events):
    table = free_form(events)
    full = [f for f in replay([table], False).findings() if f.code in AFFECTED_CODES]
    assert assert_same([table], codes=AFFECTED_CODES) == full


# ---- synthetic allocator streams -------------------------------------------------------------------------


def synth(node: str, seed: int, pages: int, **kw) -> list[pa.Table]:
    prod = Producer("c", node, "decode", "kvtrail-synth", "0", f"{node}-i")
    return list(
        synth_batches(
            producer=prod,
            num_pages=512,
            page_size=16,
            seed=seed,
            target_page_events=pages,
            events_per_batch=700,
            prompt_median_tokens=600,
            max_prompt_tokens=2048,
            **kw,
        )
    )


def with_reads(table: pa.Table, every: int = 1) -> pa.Table:
    """Each kv_written followed by the reader's kv_read of the same pages (for every ``every``-th write, the
    read comes without the write: the incident's unwritten pages)."""
    kind = table.column("kind").to_numpy(zero_copy_only=False)
    rows, is_read = [], []
    for i, k in enumerate(kind):
        if k == "kv_written":
            if not (every > 1 and i % every == 0):
                rows.append(i)
                is_read.append(False)
            rows.append(i)
            is_read.append(True)
        else:
            rows.append(i)
            is_read.append(False)
    out = table.take(pa.array(rows))
    mask = pa.array(is_read)
    cols = {name: out.column(name) for name in out.column_names}
    cols["kind"] = pa.array(np.where(is_read, "kv_read", out.column("kind").to_numpy(zero_copy_only=False)))
    for name in ("token_start", "token_end", "source"):
        cols[name] = pa.compute.if_else(mask, pa.nulls(len(rows), out.column(name).type), out.column(name))
    cols["seq"] = pa.array(
        np.arange(out.column("seq")[0].as_py(), out.column("seq")[0].as_py() + len(rows), dtype=np.uint64)
    )
    return pa.table(cols, schema=out.schema)


@pytest.mark.parametrize("reuse,decode_fraction", [("lowest", 0.6), ("lifo", 0.0)])
def test_synth_streams_fast_equals_pure(reuse, decode_fraction):
    tables = synth("n1", 3, 60_000, reuse=reuse, decode_fraction=decode_fraction)
    found = assert_same(tables)
    assert found == []  # warm-up frees and clean churn: nothing to find


def test_the_kernel_replays_the_common_case(monkeypatch):
    """Only the node_config goes through a handler in a clean stream with reads; the rest is compiled."""
    table = with_reads(pa.concat_tables(synth("n1", 4, 60_000, warmup_page_events=0)).combine_chunks())
    calls = []
    for kind in ("node_config", "pages_allocated", "pages_freed", "kv_written", "kv_read"):
        handler = getattr(EventHandlers, "on_" + kind)
        monkeypatch.setattr(
            EventHandlers, "on_" + kind, lambda self, ev, _h=handler, _k=kind: (calls.append(_k), _h(self, ev))[1]
        )
    replay([table], True)
    assert calls == ["node_config"] and table.num_rows > 1000


def test_synth_streams_with_reads_and_planted_unwritten_pages():
    a = pa.concat_tables(synth("n1", 5, 40_000)).combine_chunks()
    b = pa.concat_tables(synth("n2", 6, 40_000, decode_fraction=0.0)).combine_chunks()
    tables = [with_reads(a, every=37), with_reads(b)]
    mixed = pa.concat_tables(tables)  # two nodes in one feed, interleaved by the engine's sort
    found = assert_same([mixed])
    assert found and {f.code for f in found} == {"F1"} and {f.node for f in found} == {"n1"}
    assert assert_same(split(mixed, [1000, 5000, 9000])) == found


def test_engine_order_keeps_a_sorted_batch_and_sorts_others():
    a = pa.concat_tables(synth("n1", 8, 5_000)).combine_chunks()
    b = pa.concat_tables(synth("n2", 9, 5_000)).combine_chunks()
    assert in_engine_order(a).equals(a)
    shuffled = a.take(pa.array(np.random.default_rng(0).permutation(a.num_rows)))
    assert in_engine_order(shuffled).equals(a)
    both = pa.concat_tables([b, a])
    assert in_engine_order(both).equals(both.sort_by(ENGINE_ORDER).combine_chunks())
    assert_same([shuffled, b])


def test_store_slices_fast_equals_pure(tmp_path):
    """Many small slices (each read by the helper thread) replay exactly as one wire batch."""
    from kvtrail.forensics.replay.source import store_batches  # needs numba

    tables = [
        with_reads(pa.concat_tables(synth(node, seed, 20_000)).combine_chunks(), every=31)
        for node, seed in (("n1", 10), ("n2", 11))
    ]
    with AuditStore(tmp_path / "s.duckdb") as store:
        for t in tables:
            store.append(t)
        pure = replay_store(store.con, fast=False)
        engine = ReplayEngine(
            {
                tuple(ident): pid
                for pid, *ident in store.con.execute(
                    "SELECT producer_id, cluster, node, role, engine, engine_version, instance FROM producers"
                ).fetchall()
            }
        )
        batches = 0
        for batch in store_batches(store.con, "TRUE", [], page_events_per_slice=5_000):
            engine.feed_batch(batch)
            batches += 1
        assert batches > 10 and pure and engine.findings() == pure


def test_replay_store_on_an_inconsistent_store_reads_what_read_events_reads(tmp_path):
    """Runs missing or overlapping (a tampered store): both paths build the same lists from the runs."""
    a = pa.concat_tables(synth("n1", 12, 20_000)).combine_chunks()
    with AuditStore(tmp_path / "s.duckdb") as store:
        store.append(with_reads(a, every=23))
        store.con.execute(
            "DELETE FROM page_runs WHERE rowid IN (SELECT rowid FROM page_runs WHERE list = 0 "
            "ORDER BY seq LIMIT 40 OFFSET 500)"
        )
        store.con.execute(
            "INSERT INTO page_runs SELECT producer_id, batch_no, seq, list, 0, page_start + 3, 2 "
            "FROM page_runs WHERE list = 0 AND num_pages > 4 ORDER BY seq LIMIT 25 OFFSET 900"
        )
        pure = replay_store(store.con, fast=False)
        assert replay_store(store.con, fast=True) == pure


def test_replay_store_fast_equals_pure(tmp_path):
    a = pa.concat_tables(synth("n1", 7, 30_000)).combine_chunks()
    with AuditStore(tmp_path / "s.duckdb") as store:
        store.append(with_reads(a, every=29))
        pure = replay_store(store.con, fast=False)
        assert pure and replay_store(store.con, fast=True) == pure
        mid = a.column("wall_ns")[a.num_rows // 2].as_py()
        assert replay_store(store.con, from_ns=mid, fast=True) == replay_store(store.con, from_ns=mid, fast=False)
        affected = replay_store(store.con, codes=AFFECTED_CODES)
        assert affected == [f for f in pure if f.code in AFFECTED_CODES]
